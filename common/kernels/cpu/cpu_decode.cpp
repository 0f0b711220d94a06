// Paged decode attention on CPU: one query token per sequence, read straight from the paged KV cache.
//
// On AVX-512 and AVX2 builds, head_dim 4, 8 or 16 vectors wide (64/128/256 on AVX-512, 32/64/128 on AVX2)
// takes a register-blocked path (decode_sequences_simd below): measured for 64 sequences x 192 tokens x 30
// layers of SmolLM2's heads (bf16, 2 threads, AVX-512), 36 ms -> 19-22 ms (8 -> 13-15 GB/s of KV). It works
// through a sequence 32 tokens at a time, every head's scores (pass 1) and then every head's weighted V rows
// (pass 2) of a chunk while its rows are in L1, and prefetches the rows two chunks ahead (prefetcht0: the
// blocks of a serving workload's sequences are scattered over the cache, where the hardware prefetcher loses
// the stream). Session 31 (a sweep per head over the whole sequence, the block two ahead prefetched by the
// first): 2-core Xeon (Sapphire Rapids class), 48 sequences x 484 tokens x 30 layers, bf16, 39-40 -> 28-30 ms.
// Session 36, chunks: on a 2-core AVX2 EPYC (Zen 3, 512 KB L2) the later heads' sweeps of a 484-token sequence
// had gone back to DRAM; the same shapes in fp32 77-88 -> 64-79 ms (a hot, L3-resident cache on one thread
// 3.1-3.9 -> 2.2 ms). Session 38 (SpreadPrefetch): the prefetches of the rows ahead go out a row at a time over
// a chunk's work instead of in one burst before it, so the arithmetic no longer waits for them: 2-core Zen 5,
// 48 x 1,050 tokens x 30 layers, bf16, 63-76 -> 37-39 ms (15-18 -> 30 GB/s of the 36 this layout streams), fp32
// 103 -> 76 ms, the AVX2 build 78 -> 50 ms. bf16 scores on AVX512-BF16: scores_w_dot (L3-resident caches 3.98 ->
// 3.49 ms at that shape on 8 sequences; DRAM-bound the same). Sharing each K row's load among a group's query
// heads (as pass 2 shares V) was measured slower (contiguous 14.9 -> 16.5 ms: the partial sums spill). The
// generic loop serves other head sizes and plain builds.
//
// The torch path gathers every sequence's K/V into scratch buffers, copies them head-major and runs two
// small batched GEMMs: three passes over the KV bytes and many tiny ops per layer. This kernel reads
// each cached K/V row once, in place, through the block table. Work items are sequences, split over
// torch's intra-op threads; a GQA group's query heads share each K/V row they read. Per sequence: scores
// for every head over every cached token (fp32), softmax, then the probability-weighted sum of V. The kernel is bound by reading the KV cache (a decode step streams every
// layer's KV from DRAM): register-blocked variants with compile-time head_dim and group measured the same.
//
// Shapes: query [n, H, D] contiguous; key/value cache [num_blocks, block_size, H_kv, D] with any block,
// token and head strides and unit stride over D; block_tables [n, max_blocks] int32; seq_lens [n] int32 or
// int64 (the metadata's own int32 tensor is read as it is: no conversion per layer). window > 0: a sliding
// window (Mistral, Qwen2/Qwen3's sliding layers) — the query, at position len - 1, reads only positions
// >= len - window (itself and the window - 1 before it, transformers' mask); 0 reads the whole sequence.
//
// The module is this file followed by cpu_kv_write.cpp (``write_kv``), in one translation unit.
// torch: common/kernels/cpu/kernel_api.h, which common/kernels/build.py puts first
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// One row of D elements to fp32. bf16 is the top half of an fp32: a shift the compiler vectorises
// (c10::BFloat16's conversion goes through a scalar call and does not).
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t D) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<uint32_t>(bits[d]) << 16;
}

// Softmax of one row in place, fp32 (exp vectorised by the compiler's vector math library); the row's max and sum
// of exps where asked (a cascade's suffix merges with its prefix by them).
inline void softmax_row(float* r, int64_t len, float* max_out = nullptr, float* sum_out = nullptr) {
  const float m = *std::max_element(r, r + len);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    r[t] = std::exp(r[t] - m);
    sum += r[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < len; ++t) r[t] *= inv;
  if (max_out != nullptr) *max_out = m;
  if (sum_out != nullptr) *sum_out = sum;
}

// Cascade decode attention (session 39). Where a call's sequences start with the same blocks (one system prompt
// before every request, prefix caching's shared blocks), each sequence's sweep read those rows again and scored
// them one query at a time. Instead, the shared prefix goes once through the prefill kernel's GEMM-shaped loops
// for every sequence's query rows at once (cpu_prefill_attn.cpp's cascade_prefix: K and V packed once, 16
// sequences' rows a tile), leaving each query row's softmax state over the prefix; each sequence's own rows after
// it (its suffix) are then swept as before and merged with that state before the output is rounded. fp32 on the
// AVX-512 and AVX2 builds, bf16 on CPUs with AVX512-BF16 (the prefill kernel's vector paths); no sliding window;
// ``set_cascade(false)`` turns it off.
//
// The prefix state of query row ((s - begin) * nh + h) * G + g (KV heads [h_begin, h_begin + nh)): the running max
// of its scaled scores, the sum of their exps and the unnormalised output, D floats in natural order, over keys
// [0, prefix).
struct PrefixState {
  int64_t prefix = 0;
  const float* o = nullptr;
  const float* mx = nullptr;
  const float* sum = nullptr;
};

bool cascade_on = true;  // set_cascade; read by every call (a plain flag: set at load, before any step runs)

template <typename scalar_t>
void decode_sequences(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t kstride[3],
                      const int64_t vstride[3], const int32_t* tables, int64_t table_stride, const int64_t* lens,
                      scalar_t* out, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale,
                      int64_t begin, int64_t end, int64_t window) {
  const int64_t G = H / Hkv;
  std::vector<float> qf(H * D), acc(H * D), row(D), scores;
  for (int64_t s = begin; s < end; ++s) {
    // Positions [first, lens[s]) are read; scores are indexed from first (len of them).
    const int64_t first = window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0;
    const int64_t len = lens[s] - first;
    const int32_t* table = tables + s * table_stride;
    scores.resize(H * len);  // scores[head * len + t]
    to_float(q + s * H * D, qf.data(), H * D);
    for (int64_t i = 0; i < H * D; ++i) qf[i] *= scale;
    // Pass 1: scores = q . k for every head and cached token, block by block (no division per token);
    // a token's K rows for all KV heads are adjacent in the cache.
    for (int64_t start = first; start < first + len; start = (start / block_size + 1) * block_size) {
      const int64_t stop = std::min((start / block_size + 1) * block_size, first + len);
      const scalar_t* kp = kc + table[start / block_size] * kstride[0] + (start % block_size) * kstride[1];
      for (int64_t t = start - first; t < stop - first; ++t, kp += kstride[1]) {
        for (int64_t h = 0; h < Hkv; ++h) {
          to_float(kp + h * kstride[2], row.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            const float* qh = qf.data() + (h * G + g) * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * row[d];
            scores[(h * G + g) * len + t] = dot;
          }
        }
      }
    }
    for (int64_t head = 0; head < H; ++head) softmax_row(scores.data() + head * len, len);
    // Pass 2: out[head] = sum_t p[head, t] * v_t.
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t start = first; start < first + len; start = (start / block_size + 1) * block_size) {
      const int64_t stop = std::min((start / block_size + 1) * block_size, first + len);
      const scalar_t* vp = vc + table[start / block_size] * vstride[0] + (start % block_size) * vstride[1];
      for (int64_t t = start - first; t < stop - first; ++t, vp += vstride[1]) {
        for (int64_t h = 0; h < Hkv; ++h) {
          to_float(vp + h * vstride[2], row.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[(h * G + g) * len + t];
            float* a = acc.data() + (h * G + g) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * row[d];
          }
        }
      }
    }
    scalar_t* o = out + s * H * D;
    for (int64_t i = 0; i < H * D; ++i) o[i] = static_cast<scalar_t>(acc[i]);
  }
}


#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
// SIMD path for head_dim a multiple of 2W (W fp32 lanes: 16 on AVX-512, 8 on AVX2): per (sequence, query
// head), K and V rows held in registers as ND = D / W vectors. Scores: each token's ND products fold into
// one vector, and W tokens' vectors reduce to one vector of W scores in a shuffle tree (~3 instructions a
// token, where a horizontal sum per token takes ~8). Output: the accumulators stay in registers over all
// tokens, for as many of a KV head's query heads as fit, so each V row is read and widened once for them.
// bf16 rows are read as even/odd 32-bit lanes (the low half shifted up, the high half masked: exact), so q
// and the output are kept in that lane order and put back at the end.
#if defined(__AVX512F__)
using vec = __m512;
constexpr int W = 16;
constexpr int kRegisters = 32;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline vec vset1(float a) { return _mm512_set1_ps(a); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline void load_pairs(const c10::BFloat16* p, vec& even, vec& odd) {  // 2W bf16
  const __m512i raw = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// W vectors -> one vector whose lane i is the sum of v[i]'s lanes.
inline vec reduce_lanes(vec* v) {
  vec s[8], u[4];
  for (int j = 0; j < 8; ++j)
    s[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d c = _mm512_castps_pd(s[2 * j]), d = _mm512_castps_pd(s[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  const vec x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const vec x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}
#else
using vec = __m256;
constexpr int W = 8;
constexpr int kRegisters = 16;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
inline vec vset1(float a) { return _mm256_set1_ps(a); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline void load_pairs(const c10::BFloat16* p, vec& even, vec& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline vec reduce_lanes(vec* v) {
  vec s[4], u[2];
  for (int j = 0; j < 4; ++j)
    s[j] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm256_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 2; ++j) {
    const __m256d c = _mm256_castps_pd(s[2 * j]), d = _mm256_castps_pd(s[2 * j + 1]);
    u[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(c, d)), _mm256_castpd_ps(_mm256_unpackhi_pd(c, d)));
  }
  // u[j]: tokens 4j..4j+3 in each 128-bit half; add the halves, tokens 0-3 low, 4-7 high
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
#endif

inline void row_to_vectors(const float* p, vec* v, int nd) {
  for (int i = 0; i < nd; ++i) v[i] = vload(p + W * i);
}
inline void row_to_vectors(const c10::BFloat16* p, vec* v, int nd) {
  for (int i = 0; i < nd; i += 2) load_pairs(p + W * i, v[i], v[i + 1]);
}
// The order row_to_vectors gives: fp32 as it is; bf16, per 2W elements, the even ones then the odd ones.
template <typename scalar_t>
inline int64_t lane_of(int64_t d) {
  if constexpr (std::is_same_v<scalar_t, float>) return d;
  const int64_t base = d & ~int64_t{2 * W - 1}, j = d & (2 * W - 1);
  return base + (j & 1) * W + (j >> 1);
}

// sc[0, W) = q . k_t for the n <= W tokens of rows (their K rows at ``koff``; zeros past n), one vector store;
// pf.step(n) once (SpreadPrefetch: in the token loop, its bookkeeping cost the loop's registers).
template <typename scalar_t, int ND, typename Pf>
inline void scores_w(const scalar_t* const* rows, int64_t n, int64_t koff, const vec* qv, float* sc, Pf& pf) {
  vec part[W];
  for (int64_t i = 0; i < W; ++i) {
    if (i >= n) {
      part[i] = vzero();
      continue;
    }
    vec kv[ND];
    row_to_vectors(rows[i] + koff, kv, ND);
    vec a = vmul(kv[0], qv[0]), c = vmul(kv[1], qv[1]);
    for (int j = 2; j < ND; j += 2) {
      a = vfma(kv[j], qv[j], a);
      c = vfma(kv[j + 1], qv[j + 1], c);
    }
    part[i] = vadd(a, c);
  }
  vstore(sc, reduce_lanes(part));
  pf.step(n);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#pragma GCC push_options
#pragma GCC target("avx512bf16")
// scores_w for bf16 on CPUs with AVX512-BF16 (tandem_amx::bf16_dot()): each K row times the query's own bf16 values
// in ``vdpbf16ps`` (two products a lane, no widening), the W sums scaled at the end. qb: the query head's ND / 2
// vectors of 2W bf16, in the row's order. Half the instructions of the widened loop a token and head (a step's
// attention at 48 x 1,050 tokens, 2-core Zen 5: see decode_sequences_simd).
template <int ND, typename Pf>
inline void scores_w_dot(const c10::BFloat16* const* rows, int64_t n, int64_t koff, const __m512bh* qb, float scale,
                         float* sc, Pf& pf) {
  constexpr int NB = ND / 2;  // bf16 vectors a row
  vec part[W];
  for (int64_t i = 0; i < W; ++i) {
    if (i >= n) {
      part[i] = vzero();
      continue;
    }
    const c10::BFloat16* r = rows[i] + koff;
    auto kb = [&](int j) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(r + 2 * W * j)); };
    __m512 a = _mm512_dpbf16_ps(vzero(), kb(0), qb[0]);
    __m512 c = NB > 1 ? _mm512_dpbf16_ps(vzero(), kb(1), qb[1]) : vzero();
    for (int j = 2; j < NB; j += 2) {
      a = _mm512_dpbf16_ps(a, kb(j), qb[j]);
      c = _mm512_dpbf16_ps(c, kb(j + 1), qb[j + 1]);
    }
    part[i] = vadd(a, c);
  }
  vstore(sc, vmul(reduce_lanes(part), vset1(scale)));
  pf.step(n);
}
#pragma GCC pop_options
#endif

// outs[g] += sum_t p[g][t] * v_t over one chunk of tokens, for GN query heads of one KV head at once: the
// accumulators come from and go back to outs, so a head's sums over the chunks of a sequence add the tokens in
// the order one sweep over all of them would (the same floats). pf.step() once a token.
template <typename scalar_t, int ND, int GN, typename Pf>
void weighted_values(const scalar_t* const* vrows, int64_t len, const float* const* p, float* const* outs, Pf& pf) {
  vec acc[GN][ND];
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < ND; ++j) acc[g][j] = vload(outs[g] + W * j);
  for (int64_t t = 0; t < len; ++t) {
    pf.step();
    vec vv[ND];
    row_to_vectors(vrows[t], vv, ND);
    for (int g = 0; g < GN; ++g) {
      const vec pt = vset1(p[g][t]);
      for (int j = 0; j < ND; ++j) acc[g][j] = vfma(pt, vv[j], acc[g][j]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < ND; ++j) vstore(outs[g] + W * j, acc[g][j]);
}

// Query heads whose accumulators fit in registers beside one V row: 1 to 4.
template <int ND>
constexpr int max_heads() {
  return std::max(1, std::min(4, kRegisters / ND - 1));
}

template <typename scalar_t, int ND, typename Pf>
void weighted_values_n(int gn, const scalar_t* const* vrows, int64_t len, const float* const* p, float* const* outs,
                       Pf& pf) {
  constexpr int M = max_heads<ND>();
  if constexpr (M >= 4) {
    if (gn >= 4) return weighted_values<scalar_t, ND, 4>(vrows, len, p, outs, pf);
  }
  if constexpr (M >= 3) {
    if (gn == 3) return weighted_values<scalar_t, ND, 3>(vrows, len, p, outs, pf);
  }
  if constexpr (M >= 2) {
    if (gn >= 2) return weighted_values<scalar_t, ND, 2>(vrows, len, p, outs, pf);
  }
  weighted_values<scalar_t, ND, 1>(vrows, len, p, outs, pf);
}

// Tokens a sweep works on at a time: every KV head's and query head's work on a chunk is done while its rows
// are in L1 (32 fp32 tokens of 3 KV heads of 64: 24 KB). A multiple of W on both builds.
constexpr int64_t kDecodeChunk = 32;
// Tokens ahead of a sweep whose rows are prefetched (two chunks).
constexpr int64_t kPrefetchTokens = 2 * kDecodeChunk;

inline void prefetch_rows(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// The K or V rows of tokens [t0, t1) of a sequence, heads [h_begin, h_end) of each (adjacent in a token's row).
template <typename scalar_t>
inline void prefetch_tokens(const scalar_t* const* rows, int64_t t0, int64_t t1, int64_t head_offset, int64_t bytes) {
  for (int64_t t = t0; t < t1; ++t) prefetch_rows(rows[t] + head_offset, bytes);
}

// The rows a chunk's sweep prefetches, issued a row at a time over the sweep's token iterations instead of all
// before it. A software prefetch that misses holds one of the core's few L1 miss buffers; a burst of a chunk's
// 192 lines (32 bf16 tokens x 3 heads x 128 bytes) filled them, and the sweep's own loads and arithmetic waited
// behind the burst: memory and arithmetic took turns. Spread over the sweep, the lines are in flight while it
// computes (the kernel's reads without its arithmetic, 48 x 1,050 tokens x 30 layers, 2-core Zen 5: 55 -> 31
// ms). Up to two ranges of rows (a sweep's own rows ahead, then the next pass's or sequence's first rows);
// step(n) after every n token iterations of the sweep, finish() after it.
template <typename scalar_t>
class SpreadPrefetch {
 public:
  // Rows [t0, t1) of rows (none when t0 >= t1), `bytes` from `head_offset` in each.
  void add(const scalar_t* const* rows, int64_t t0, int64_t t1, int64_t head_offset, int64_t bytes) {
    if (t0 >= t1) return;
    ranges_[n_++] = Range{rows + t0, t1 - t0, head_offset, bytes};
    total_ += t1 - t0;
  }
  // Spread the rows added over `steps` calls of step().
  void start(int64_t steps) {
    steps_ = std::max<int64_t>(1, steps);
    credit_ = 0;
  }
  inline void step(int64_t n = 1) {
    credit_ += total_ * n;
    while (credit_ >= steps_ && r_ < n_) {
      credit_ -= steps_;
      issue();
    }
  }
  // What step() left (rounding), then empty again for the next sweep.
  void finish() {
    while (r_ < n_) issue();
    n_ = r_ = 0;
    total_ = row_ = 0;
  }

 private:
  struct Range {
    const scalar_t* const* rows;
    int64_t count, head_offset, bytes;
  };
  inline void issue() {
    const Range& r = ranges_[r_];
    prefetch_rows(r.rows[row_] + r.head_offset, r.bytes);
    if (++row_ == r.count) {
      row_ = 0;
      ++r_;
    }
  }
  Range ranges_[2];
  int n_ = 0, r_ = 0;
  int64_t total_ = 0, steps_ = 1, credit_ = 0, row_ = 0;
};

template <typename scalar_t, int ND>
void decode_sequences_simd(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t kstride[3],
                           const int64_t vstride[3], const int32_t* tables, int64_t table_stride,
                           const int64_t* lens, scalar_t* out, int64_t H, int64_t Hkv, int64_t block_size,
                           float scale, int64_t begin, int64_t end, int64_t h_begin, int64_t h_end, int64_t window,
                           bool allow_dot, const PrefixState* ps = nullptr) {
  // KV heads [h_begin, h_end) of each sequence (default: all): a head's output depends only on its own
  // reads, so a batch-1 step can split the heads over threads (common/kernels/cpu/cpu_step.cpp).
  //
  // Chunk by chunk: pass 1 computes every (KV head, query head)'s scores of kDecodeChunk tokens while those K rows
  // are in L1, prefetching the rows kPrefetchTokens ahead; pass 2 adds every head's weighted V rows of a chunk
  // the same way. A sweep per head over the whole sequence (the kernel before) read each row once per head,
  // and with a 512 KB L2 (Zen 3) the second and third heads' sweeps went back to DRAM: 2-core AVX2 EPYC, 48 x
  // 484 tokens x 30 layers, fp32, the rows were read at 13 GB/s of the 29 the cores stream (session 36).
  if (h_end < 0) h_end = Hkv;
  static_assert(ND % 2 == 0, "head_dim must be a multiple of 2W");
  constexpr int64_t D = W * ND;
  constexpr int kMaxHeads = max_heads<ND>();
  const int64_t G = H / Hkv, nh = h_end - h_begin;
  const int64_t kbytes = nh * kstride[2] * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t vbytes = nh * vstride[2] * static_cast<int64_t>(sizeof(scalar_t));
  std::vector<float> qf(nh * G * D), scores, of(nh * G * D), rmax(nh * G), rsum(nh * G);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const bool dot = std::is_same_v<scalar_t, c10::BFloat16> && allow_dot && tandem_amx::bf16_dot();
#else
  constexpr bool dot = false;  // vdpbf16ps needs an AVX-512 build
  (void)allow_dot;
#endif
  std::vector<const scalar_t*> krows, vrows;  // each token's row of KV head 0 (no division per token)
  const scalar_t* next_rows[kPrefetchTokens];  // the next sequence's first K rows, prefetched as pass 2 ends
  SpreadPrefetch<scalar_t> pf;
  for (int64_t s = begin; s < end; ++s) {
    // Positions [first, lens[s]) are read (a sliding window, a cascade's suffix, or all); rows and scores are
    // indexed from first.
    const int64_t first = ps != nullptr ? ps->prefix : window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0;
    const int64_t len = lens[s] - first;
    const int32_t* table = tables + s * table_stride;
    const int64_t stride = len + W;  // a head's scores (padded for the last W-token store)
    scores.resize(nh * G * stride);
    krows.resize(len);
    vrows.resize(len);
    for (int64_t start = first - first % block_size, b = first / block_size; start < first + len;
         start += block_size, ++b) {
      const scalar_t* kp = kc + table[b] * kstride[0];
      const scalar_t* vp = vc + table[b] * vstride[0];
      for (int64_t t = std::max(start, first), stop = std::min(start + block_size, first + len); t < stop; ++t) {
        krows[t - first] = kp + (t - start) * kstride[1];
        vrows[t - first] = vp + (t - start) * vstride[1];
      }
    }
    if (s == begin)  // the first rows (a later sequence's come with the sequence before's last chunk)
      prefetch_tokens(krows.data(), 0, std::min(len, kPrefetchTokens), h_begin * kstride[2], kbytes);
    // The query heads of KV heads [h_begin, h_end), scaled, in the lane order rows are read in (the vdpbf16ps
    // scores read the query's bf16 values as they are instead).
    for (int64_t i = 0; i < nh * G && !dot; ++i) {
      const scalar_t* qh = q + (s * H + h_begin * G + i) * D;
      for (int64_t d = 0; d < D; ++d) qf[i * D + lane_of<scalar_t>(d)] = static_cast<float>(qh[d]) * scale;
    }
    // Pass 1: the scores, W tokens at a time, chunk by chunk.
    for (int64_t c0 = 0; c0 < len; c0 += kDecodeChunk) {
      const int64_t c1 = std::min(len, c0 + kDecodeChunk);
      pf.add(krows.data(), std::min(len, c0 + kPrefetchTokens), std::min(len, c1 + kPrefetchTokens),
             h_begin * kstride[2], kbytes);
      if (c1 + kPrefetchTokens > len)  // pass 2's first V rows, as pass 1 ends
        pf.add(vrows.data(), std::max<int64_t>(0, c0 + kPrefetchTokens - len),
               std::min(len, c1 + kPrefetchTokens - len), h_begin * vstride[2], vbytes);
      pf.start(nh * G * (c1 - c0));
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t koff = (h_begin + h) * kstride[2];
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (dot) {
            for (int64_t g = 0; g < G; ++g) {
              __m512bh qb[ND / 2];
              const scalar_t* qh = q + (s * H + (h_begin + h) * G + g) * D;
              for (int j = 0; j < ND / 2; ++j)
                qb[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qh + 2 * W * j));
              float* sc = scores.data() + (h * G + g) * stride;
              for (int64_t t0 = c0; t0 < c1; t0 += W)
                scores_w_dot<ND>(krows.data() + t0, std::min<int64_t>(W, c1 - t0), koff, qb, scale, sc + t0, pf);
            }
            continue;
          }
        }
#endif
        for (int64_t g = 0; g < G; ++g) {
          vec qv[ND];
          row_to_vectors(qf.data() + (h * G + g) * D, qv, ND);
          float* sc = scores.data() + (h * G + g) * stride;
          for (int64_t t0 = c0; t0 < c1; t0 += W)
            scores_w<scalar_t, ND>(krows.data() + t0, std::min<int64_t>(W, c1 - t0), koff, qv, sc + t0, pf);
        }
      }
      pf.finish();
    }
    for (int64_t i = 0; i < nh * G; ++i) softmax_row(scores.data() + i * stride, len, &rmax[i], &rsum[i]);
    // Pass 2: every head's weighted V rows, chunk by chunk, up to kMaxHeads query heads per sweep of a chunk.
    std::fill(of.begin(), of.end(), 0.f);
    for (int64_t c0 = 0; c0 < len; c0 += kDecodeChunk) {
      const int64_t c1 = std::min(len, c0 + kDecodeChunk);
      pf.add(vrows.data(), std::min(len, c0 + kPrefetchTokens), std::min(len, c1 + kPrefetchTokens),
             h_begin * vstride[2], vbytes);
      if (s + 1 < end && c1 + kPrefetchTokens > len) {  // the next sequence's first K rows, as pass 2 ends
        const int32_t* next = tables + (s + 1) * table_stride;
        const int64_t next_first = ps != nullptr ? ps->prefix : window > 0 ? std::max<int64_t>(0, lens[s + 1] - window)
                                                                            : 0;
        const int64_t next_len = lens[s + 1] - next_first;
        const int64_t t0 = std::max<int64_t>(0, c0 + kPrefetchTokens - len);
        const int64_t t1 = std::min(next_len, c1 + kPrefetchTokens - len);  // <= kPrefetchTokens (c1 <= len)
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t pos = next_first + t;
          next_rows[t] = kc + next[pos / block_size] * kstride[0] + (pos % block_size) * kstride[1];
        }
        pf.add(next_rows, t0, t1, h_begin * kstride[2], kbytes);
      }
      pf.start(nh * ((G + kMaxHeads - 1) / kMaxHeads) * (c1 - c0));
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t voff = (h_begin + h) * vstride[2];
        const scalar_t* rows[kDecodeChunk];
        for (int64_t t = c0; t < c1; ++t) rows[t - c0] = vrows[t] + voff;
        for (int64_t g0 = 0; g0 < G; g0 += kMaxHeads) {
          const int gn = static_cast<int>(std::min<int64_t>(kMaxHeads, G - g0));
          const float* p[kMaxHeads];
          float* outs[kMaxHeads];
          for (int g = 0; g < gn; ++g) {
            p[g] = scores.data() + (h * G + g0 + g) * stride + c0;
            outs[g] = of.data() + (h * G + g0 + g) * D;
          }
          weighted_values_n<scalar_t, ND>(gn, rows, c1 - c0, p, outs, pf);
        }
      }
      pf.finish();
    }
    for (int64_t i = 0; i < nh * G; ++i) {
      scalar_t* o = out + (s * H + h_begin * G + i) * D;
      if (ps != nullptr) {  // merged with the prefix's state: both parts' exps against the larger max
        const int64_t r = (s - begin) * nh * G + i;
        const float m = std::max(ps->mx[r], rmax[i]);
        const float a1 = std::exp(ps->mx[r] - m), a2 = std::exp(rmax[i] - m) * rsum[i];
        const float inv = 1.f / (ps->sum[r] * a1 + a2);
        const float* o1 = ps->o + r * D;
        for (int64_t d = 0; d < D; ++d)
          o[d] = static_cast<scalar_t>((o1[d] * a1 + of[i * D + lane_of<scalar_t>(d)] * a2) * inv);
        continue;
      }
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(of[i * D + lane_of<scalar_t>(d)]);
    }
  }
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// cpu_prefill_attn.cpp (later in this translation unit): the prefix state of sequences [begin, end)'s query rows of
// KV heads [h_begin, h_end) into ``state`` and ``ps``, where they share at least kCascadeMinPrefix tokens' blocks
// and are at least kCascadeMinSeqs; false (nothing computed) where the cascade does not pay or apply. fp32 on both
// vector builds; bf16 on the AVX-512 build where the CPU has AVX512-BF16.
bool cascade_prefix(const float* q, const float* kc, const float* vc, const int64_t* kstride, const int64_t* vstride,
                    const int32_t* tables, int64_t table_stride, const int64_t* lens, int64_t H, int64_t Hkv,
                    int64_t D, int64_t block_size, float scale, int64_t begin, int64_t end, int64_t h_begin,
                    int64_t h_end, std::vector<float>& state, PrefixState& ps);
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
bool cascade_prefix(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* kstride,
                    const int64_t* vstride, const int32_t* tables, int64_t table_stride, const int64_t* lens, int64_t H,
                    int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t begin, int64_t end,
                    int64_t h_begin, int64_t h_end, std::vector<float>& state, PrefixState& ps);
#endif

}  // namespace

// For common/kernels/cpu/cpu_step.cpp's one-call decode step (another module): attention of sequences
// [begin, end), KV heads [h_begin, h_end), fp32 or bf16 (q, caches and out of one dtype), through this
// module's own code and flags (-ffast-math: glibc's vector exp in the softmax), so the step's rows equal
// paged_decode's bit for bit. A head range other than all heads needs a SIMD head size
// (decode_splits_heads). The step takes the address once, from Python.
// window_rows: the same with a sliding window (paged_decode's; the step's address keeps decode_rows' signature
// and reads whole sequences: DecodeStep.for_model declines windowed models).
template <typename scalar_t>
void window_rows(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t* kstride,
                 const int64_t* vstride, const int32_t* tables, int64_t table_stride, const int64_t* lens, scalar_t* out,
                 int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t begin, int64_t end,
                 int64_t h_begin, int64_t h_end, int64_t window, bool allow_dot = true) {
#if defined(__AVX512F__) || defined(__AVX2__)
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    constexpr bool cascades = true;
#else
    constexpr bool cascades = std::is_same_v<scalar_t, float>;  // bf16 needs the AVX-512 build's vdpbf16ps
#endif
    // A shared prefix's state, where the cascade runs (then window is 0): the sweeps below read only the suffixes.
    // bf16: where the scores are vdpbf16ps sums (allow_dot; cascade_prefix checks the CPU); fp32: always.
    const PrefixState* cascade = nullptr;
    PrefixState ps;
    if constexpr (cascades) {
      thread_local std::vector<float> state;
      if (cascade_on && (allow_dot || std::is_same_v<scalar_t, float>) && window == 0 &&
          (D == 4 * W || D == 8 * W || D == 16 * W) &&
          cascade_prefix(q, kc, vc, kstride, vstride, tables, table_stride, lens, H, Hkv, D, block_size, scale, begin,
                         end, h_begin, h_end < 0 ? Hkv : h_end, state, ps))
        cascade = &ps;
    }
    if (D == 4 * W) return decode_sequences_simd<scalar_t, 4>(q, kc, vc, kstride, vstride, tables, table_stride, lens,
                                                               out, H, Hkv, block_size, scale, begin, end, h_begin,
                                                               h_end, window, allow_dot, cascade);
    if (D == 8 * W) return decode_sequences_simd<scalar_t, 8>(q, kc, vc, kstride, vstride, tables, table_stride, lens,
                                                               out, H, Hkv, block_size, scale, begin, end, h_begin,
                                                               h_end, window, allow_dot, cascade);
    if (D == 16 * W) return decode_sequences_simd<scalar_t, 16>(q, kc, vc, kstride, vstride, tables, table_stride,
                                                                 lens, out, H, Hkv, block_size, scale, begin, end,
                                                                 h_begin, h_end, window, allow_dot, cascade);
  }
#endif
  (void)h_begin;
  (void)h_end;
  (void)allow_dot;
  decode_sequences<scalar_t>(q, kc, vc, kstride, vstride, tables, table_stride, lens, out, H, Hkv, D, block_size,
                             scale, begin, end, window);
}

template <typename scalar_t>
void decode_rows(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t* kstride,
                 const int64_t* vstride, const int32_t* tables, int64_t table_stride, const int64_t* lens, scalar_t* out,
                 int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t begin, int64_t end,
                 int64_t h_begin, int64_t h_end) {
  window_rows<scalar_t>(q, kc, vc, kstride, vstride, tables, table_stride, lens, out, H, Hkv, D, block_size, scale,
                        begin, end, h_begin, h_end, 0);
}

// Cascade decode attention on or off for this module (common/kernels/cpu/__init__.py: TANDEM_CPU_CASCADE); whether it
// can run here: fp32 on the AVX-512 and AVX2 builds, bf16 too where the CPU has AVX512-BF16 (the AVX-512 build).
bool set_cascade(bool on) {
  cascade_on = on;
#if defined(__AVX512F__) || defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

bool decode_splits_heads(int64_t head_dim) {
#if defined(__AVX512F__) || defined(__AVX2__)
  return head_dim == 4 * W || head_dim == 8 * W || head_dim == 16 * W;
#else
  (void)head_dim;
  return false;
#endif
}

// The address of decode_rows for the step's dtype: "float32" or "bfloat16".
int64_t decode_rows_address(const std::string& dtype) {
  if (dtype == "float32") return reinterpret_cast<int64_t>(&decode_rows<float>);
  TORCH_CHECK(dtype == "bfloat16", "decode_rows_address: float32 or bfloat16, not ", dtype);
  return reinterpret_cast<int64_t>(&decode_rows<c10::BFloat16>);
}

namespace {
torch::Tensor paged_decode_impl(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window,
                                bool allow_dot) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [n, H, D] tensor");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4, "caches must be [blocks, block_size, H_kv, D]");
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1, "caches need unit stride over D");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() && value_cache.scalar_type() == query.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.stride(1) == 1, "block_tables: int32 rows");
  TORCH_CHECK((seq_lens.scalar_type() == torch::kInt64 || seq_lens.scalar_type() == torch::kInt32) &&
                  seq_lens.is_contiguous(), "seq_lens: contiguous int32 or int64");
  const int64_t n = query.size(0), H = query.size(1), D = query.size(2);
  TORCH_CHECK(seq_lens.numel() == n, "seq_lens: one per query row");
  TORCH_CHECK(window >= 0, "window: 0 (the whole sequence) or the positions a query reads");
  std::vector<int64_t> lens(n);
  if (seq_lens.scalar_type() == torch::kInt64) {
    std::copy(seq_lens.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>() + n, lens.begin());
  } else {
    std::copy(seq_lens.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>() + n, lens.begin());
  }
  const int64_t block_size = key_cache.size(1), Hkv = key_cache.size(2);
  TORCH_CHECK(H % Hkv == 0 && key_cache.size(3) == D, "head counts or head_dim do not match");
  auto out = torch::empty_like(query);
  const int64_t kstride[3] = {key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)};
  const int64_t vstride[3] = {value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)};
  // fp32 and bf16 (what CPUs serve in); fp16 stays on the PyTorch path.
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "paged_decode: float32 or bfloat16 only");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "paged_decode", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* kc = key_cache.data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      window_rows<scalar_t>(q, kc, vc, kstride, vstride, tables, block_tables.stride(0), lens.data(), o, H, Hkv, D,
                            block_size, static_cast<float>(scale), begin, end, 0, Hkv, window, allow_dot);
    });
  });
  return out;
}
}  // namespace

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window) {
  return paged_decode_impl(query, key_cache, value_cache, block_tables, seq_lens, scale, window, true);
}

// paged_decode with bf16 scores from K rows widened to fp32 even where the CPU has AVX512-BF16 (where it does,
// paged_decode multiplies bf16 pairs in ``vdpbf16ps``): the tests check both paths on one machine.
torch::Tensor paged_decode_widened(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                   torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window) {
  return paged_decode_impl(query, key_cache, value_cache, block_tables, seq_lens, scale, window, false);
}
