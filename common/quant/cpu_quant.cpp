// Weight-only quantized matmuls on CPU: y[M, N] = x[M, K] @ dequant(W)[N, K]^T; x and y fp32 or bf16
// (the sums are fp32 either way).
//
// At decode batch sizes a linear layer is bound by streaming its weights from DRAM, so these kernels read
// the packed bytes once, widen them to fp32 in registers and multiply-add against x (held in L1). The
// same source is compiled once per instruction set (-mavx512f..., -mavx2 -mfma, or plain C++) into
// separate extension modules; common/quant/cpu_kernels.py picks one at run time from the CPU's flags.
//
// Layouts (common/quant/formats.py documents them; the Python reference there is the oracle):
//   int4: q uint8 [N, K/2]; each 32-weight sub-block is 16 bytes, byte j holds weight j in its low nibble
//         and weight j + 16 in its high nibble (GGUF's Q4_1 order); scales, zeros fp16 [N, K/G]:
//         w = scale * q + zero. G is a multiple of 32.
//   int8: q int8 [N, K]; scales fp32 [N, K/G]: w = scale * q (G = K: one scale per output channel).
//
// ``dense_matmul``: the same GEMV for float weights (fp32 or bf16 [N, K]), for decode-size batches of
// unquantized models: oneDNN / MKL stream a small layer's weights at about half the read bandwidth on two
// cores; prefetching the next tiles' rows gets close to it.
//
// ``*_matmul_a8``: the same products with the activations rounded to int8 first, in blocks of 32 with one
// fp32 scale each (as llama.cpp's Q8 activations), so the inner loop is integer dot products of packed
// bytes: ``vpmaddubsw`` + ``vpmaddwd`` on AVX2 and AVX-512 builds (AVX512-VNNI's ``vpdpbusd`` measured no
// faster on Zen 4, and slower for int8 weights), a plain loop otherwise. Per 32 weights that is ~6 instructions instead of ~14, which is what makes a 4-bit GEMV
// stream at memory speed on two cores. ``formats.reference_a8_matmul`` is its math.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t SUB = 32;  // weights per packed sub-block

#if defined(__AVX512F__) && defined(__AVX512BW__)
const char* const kIsa = "avx512";
constexpr int VL = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline void unpack_q4(const uint8_t* p, vf* w) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
  w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
}
inline void unpack_q8(const int8_t* p, vf* w) {
  w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
}
// fp32 -> bf16 rounds to nearest even (as torch's .to(torch.bfloat16)); weights are finite.
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline void vstore(at::BFloat16* p, vf a) {
  const __m512i bits = _mm512_castps_si512(a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
constexpr int kAccumulators = 8;  // vector accumulators per tile; 32 zmm registers leave room for the rest
#elif defined(__AVX2__) && defined(__FMA__)
const char* const kIsa = "avx2";
constexpr int VL = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf widen_u8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
inline void unpack_q4(const uint8_t* p, vf* w) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  w[0] = widen_u8(lo);
  w[1] = widen_u8(_mm_srli_si128(lo, 8));
  w[2] = widen_u8(hi);
  w[3] = widen_u8(_mm_srli_si128(hi, 8));
}
inline void unpack_q8(const int8_t* p, vf* w) {
  for (int v = 0; v < 4; ++v) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v));
    w[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
}
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline void vstore(at::BFloat16* p, vf a) {
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
constexpr int kAccumulators = 8;  // 16 ymm registers: 8 accumulators, 4 weights, scales, x
#else
const char* const kIsa = "generic";
constexpr int VL = 1;
using vf = float;
inline vf vzero() { return 0.f; }
inline vf vset1(float a) { return a; }
inline vf vload(const float* p) { return *p; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf vmul(vf a, vf b) { return a * b; }
inline float vsum(vf a) { return a; }
inline void unpack_q4(const uint8_t* p, vf* w) {
  for (int j = 0; j < 16; ++j) {
    w[j] = static_cast<float>(p[j] & 0x0F);
    w[j + 16] = static_cast<float>(p[j] >> 4);
  }
}
inline void unpack_q8(const int8_t* p, vf* w) {
  for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(p[j]);
}
inline void vstore(float* p, vf a) { *p = a; }
inline void vstore(at::BFloat16* p, vf a) {
  uint32_t bits;
  std::memcpy(&bits, &a, sizeof(bits));
  const uint16_t r = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  std::memcpy(p, &r, sizeof(r));
}
constexpr int kAccumulators = 32;
#endif

constexpr int NV = SUB / VL;  // vectors per sub-block

// A tile reads its R rows' bytes interleaved (row 0's block b, row 1's block b, ...), a pattern the
// hardware prefetcher follows poorly on short rows, so each step also prefetches the matching bytes of the
// tile PREFETCH_TILES ahead: the packed matrix arrives at close to the core's streaming rate.
constexpr int64_t PREFETCH_TILES = 2;
inline void prefetch(const void* p) {
#if defined(__AVX2__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#else
  __builtin_prefetch(p);
#endif
}

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// R output rows x MT activation rows, K reduced. Weights are widened and scaled in registers
// (w = s * q + z) and multiply-added into R * MT * NV independent accumulators, so the FMA latency
// chain never throttles the stream.
template <int R, int MT>
void q4_tile(const float* x, int64_t ldx, const uint8_t* q, const uint16_t* s, const uint16_t* z, int64_t K,
             int64_t G, int64_t n0, float* y, int64_t ldy) {
  const int64_t row_bytes = K / 2, groups = K / G;
  vf acc[R][MT][NV];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < NV; ++v) acc[r][m][v] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    vf sc[R], zc[R];
    for (int r = 0; r < R; ++r) {
      sc[r] = vset1(half_to_float(s[(n0 + r) * groups + g]));
      zc[r] = vset1(half_to_float(z[(n0 + r) * groups + g]));
    }
    for (int64_t k = g * G; k < (g + 1) * G; k += SUB) {
      for (int r = 0; r < R; ++r) {
        vf w[NV];
        unpack_q4(q + (n0 + r) * row_bytes + k / 2, w);
        for (int v = 0; v < NV; ++v) w[v] = vfma(w[v], sc[r], zc[r]);
        for (int m = 0; m < MT; ++m)
          for (int v = 0; v < NV; ++v) acc[r][m][v] = vfma(w[v], vload(x + m * ldx + k + v * VL), acc[r][m][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      float total = 0.f;
      for (int v = 0; v < NV; ++v) total += vsum(acc[r][m][v]);
      y[m * ldy + n0 + r] = total;
    }
}

// int8: with one scale per row (G == K) the raw products are summed and scaled once at the end;
// with groups (GGUF Q8_0, G = 32) each weight vector is scaled in registers first.
template <int R, int MT>
void q8_tile(const float* x, int64_t ldx, const int8_t* q, const float* s, int64_t K, int64_t G, int64_t n0,
             float* y, int64_t ldy) {
  const int64_t groups = K / G;
  const bool per_row = groups == 1;
  vf acc[R][MT][NV];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < NV; ++v) acc[r][m][v] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    vf sc[R];
    for (int r = 0; r < R; ++r) sc[r] = vset1(s[(n0 + r) * groups + g]);
    for (int64_t k = g * G; k < (g + 1) * G; k += SUB) {
      for (int r = 0; r < R; ++r) {
        vf w[NV];
        unpack_q8(q + (n0 + r) * K + k, w);
        if (!per_row)
          for (int v = 0; v < NV; ++v) w[v] = vmul(w[v], sc[r]);
        for (int m = 0; m < MT; ++m)
          for (int v = 0; v < NV; ++v) acc[r][m][v] = vfma(w[v], vload(x + m * ldx + k + v * VL), acc[r][m][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      float total = 0.f;
      for (int v = 0; v < NV; ++v) total += vsum(acc[r][m][v]);
      y[m * ldy + n0 + r] = per_row ? total * s[n0 + r] : total;
    }
}

// Rows per tile for MT activation rows: as many as the accumulator budget allows.
template <int MT>
constexpr int rows_for() {
  return std::max(1, kAccumulators / (MT * NV));
}

// Runs tile(R, MT) over all N rows in parallel and all M rows in tiles of 4, 2, 1.
template <typename Tile, typename TileOne>
void run_tiles(int64_t M, int64_t N, int R, Tile tile, TileOne tile_one) {
  const int64_t blocks = (N + R - 1) / R;
  at::parallel_for(0, blocks, std::max<int64_t>(1, 64 / R), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * R;
      if (n0 + R <= N) {
        tile(n0);
      } else {
        for (int64_t n = n0; n < N; ++n) tile_one(n);
      }
    }
  });
}

// x: contiguous [M, K], fp32 or bf16, read as fp32: bf16 is widened here into ``scratch`` (no ATen call).
const float* float_x(const torch::Tensor& x, int64_t K, std::vector<float>& scratch) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  const int64_t n = x.numel();
  scratch.resize(n);
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(&scratch[i], &bits, sizeof(float));
  }
  return scratch.data();
}

// The [M, N] result in x's dtype: fp32 is written in place; bf16 is computed in ``scratch`` and rounded once.
struct Out {
  torch::Tensor y;
  std::vector<float> scratch;
  float* data;
  Out(const torch::Tensor& x, int64_t M, int64_t N) : y(torch::empty({M, N}, x.options())) {
    if (x.scalar_type() == at::kFloat) {
      data = y.data_ptr<float>();
    } else {
      scratch.resize(M * N);
      data = scratch.data();
    }
  }
  torch::Tensor finish() {
    if (y.scalar_type() == at::kFloat) return y;
    const int64_t n = y.numel();
    auto* dst = y.data_ptr<at::BFloat16>();
    int64_t i = 0;
    for (; i + VL <= n; i += VL) vstore(dst + i, vload(data + i));
    for (; i < n; ++i) dst[i] = at::BFloat16(data[i]);  // round to nearest even, as the vector store
    return y;
  }
};

template <int MT>
void q4_rows(const float* x, const uint8_t* q, const uint16_t* s, const uint16_t* z, int64_t K, int64_t G,
             int64_t N, float* y) {
  constexpr int R = rows_for<MT>();
  run_tiles(MT, N, R, [&](int64_t n0) { q4_tile<R, MT>(x, K, q, s, z, K, G, n0, y, N); },
            [&](int64_t n) { q4_tile<1, MT>(x, K, q, s, z, K, G, n, y, N); });
}

template <int MT>
void q8_rows(const float* x, const int8_t* q, const float* s, int64_t K, int64_t G, int64_t N, float* y) {
  constexpr int R = rows_for<MT>();
  run_tiles(MT, N, R, [&](int64_t n0) { q8_tile<R, MT>(x, K, q, s, K, G, n0, y, N); },
            [&](int64_t n) { q8_tile<1, MT>(x, K, q, s, K, G, n, y, N); });
}

void check_int4(const torch::Tensor& q, const torch::Tensor& scales, const torch::Tensor& zeros, int64_t G,
                int64_t K) {
  const int64_t N = q.size(0);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous(), "q must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(G % SUB == 0 && K % G == 0, "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && zeros.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  zeros.is_contiguous() && scales.numel() == N * (K / G) && zeros.numel() == scales.numel(),
              "scales, zeros must be contiguous fp16 [N, K/group_size]");
}

void check_int8(const torch::Tensor& q, const torch::Tensor& scales, int64_t G, int64_t K) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "q must be contiguous int8 [N, K]");
  TORCH_CHECK(G % SUB == 0 && K % G == 0, "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == q.size(0) * (K / G),
              "scales must be contiguous fp32 [N, K/group_size]");
}

// ---- int8 activations -------------------------------------------------------------------------------
// x [M, K] -> xq int8 [M, K], per 32-block scale d = max|x| / 127 and d * sum(xq) (the int4 zero term:
// the sum of the rounded x, so the result is exactly the product with the rounded activations and the
// rounding of x is not multiplied by the weights' offset). Rounding is to nearest even, as torch.round.
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d, gsum;  // [M, K/32] scales; [M, K/G] d * sum(xq) per weight group
};
struct QuantXRows {  // rows m0.. of a QuantX
  const int8_t* q;
  const float *d, *gsum;
};

void quantize_x(const float* x, int64_t M, int64_t K, int64_t G, QuantX& out) {
  const int64_t blocks = K / SUB, per_group = G / SUB;
  out.q.resize(M * K);
  out.d.resize(M * blocks);
  out.gsum.assign(M * (K / G), 0.f);
  for (int64_t b = 0; b < M * blocks; ++b) {
    const float* xb = x + b * SUB;
    float amax = 0.f;
    for (int j = 0; j < SUB; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int8_t* qb = out.q.data() + b * SUB;
    int32_t total = 0;
    for (int j = 0; j < SUB; ++j) {
      qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
      total += qb[j];
    }
    out.d[b] = d;
    out.gsum[b / per_group] += d * static_cast<float>(total);  // blocks of a row never straddle rows: G | K
  }
}

#if defined(__AVX2__)
using vi = __m256i;
inline vi load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// 16 packed bytes -> the 32 weights of a sub-block in order, one per byte (0..15).
// The 16 bytes go to both halves (one broadcast load), the upper half is shifted right by a nibble
// (per 64-bit lane: a byte's high nibble lands in its low bits, the next byte's low nibble above it, which
// the mask drops): 3 instructions where insert-based unpacking takes 5.
inline vi q4_bytes(const uint8_t* p) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
}
// 8 int32 lanes, each the sum of 4 products of unsigned bytes u and signed bytes s.
inline vi dot_u8s8(vi u, vi s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));  // |pair sums| <= 2*128*127
}
inline vi q4_dot(const uint8_t* w, const int8_t* x) { return dot_u8s8(q4_bytes(w), load32(x)); }
inline vi q8_dot(const int8_t* w, const int8_t* x) {  // signed x signed: |w| times x carrying w's sign
  const vi wv = load32(w);
  return dot_u8s8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(load32(x), wv));
}
using vacc = __m256;
inline vacc acc_zero() { return _mm256_setzero_ps(); }
inline vacc acc_add(vi dot, float scale, vacc acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale), acc);
}
inline float acc_sum(vacc a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
constexpr int kA8Accumulators = 8;  // 16 accumulators measured no faster on AVX-512 (32 registers)
#else
using vi = int32_t;
inline vi q4_dot(const uint8_t* w, const int8_t* x) {
  int32_t total = 0;
  for (int j = 0; j < 16; ++j) total += (w[j] & 0x0F) * x[j] + (w[j] >> 4) * x[j + 16];
  return total;
}
inline vi q8_dot(const int8_t* w, const int8_t* x) {
  int32_t total = 0;
  for (int j = 0; j < SUB; ++j) total += w[j] * x[j];
  return total;
}
using vacc = float;
inline vacc acc_zero() { return 0.f; }
inline vacc acc_add(vi dot, float scale, vacc acc) { return static_cast<float>(dot) * scale + acc; }
inline float acc_sum(vacc a) { return a; }
constexpr int kA8Accumulators = 8;
#endif

// fp16 -> fp32, 8 at a time where the build has F16C.
inline void halves_to_floats(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

// R weight rows x MT activation rows. Each sub-block adds dot(q, xq) * (scale * d_x) in fp32, in block
// order, so a row's result does not depend on how many rows share its tile (speculative verification
// rows equal plain decode rows); int4 then adds sum over groups of zero * sum(rounded x in the group).
// The tile's fp16 scales and zeros are widened once up front, 8 per instruction, not per block.
template <int R, int MT, bool INT4>
void a8_tile(const QuantXRows& xq, int64_t K, int64_t G, const void* qv, const void* sv, const uint16_t* z,
             int64_t n0, float* y, int64_t ldy) {
  const int64_t blocks = K / SUB, groups = K / G, per_group = G / SUB;
  const bool per_row = !INT4 && groups == 1;
  thread_local std::vector<float> widened;
  const float* sc;  // [R, groups] scales of the tile's rows
  const float* zc = nullptr;  // [R, groups] zeros (int4)
  if constexpr (INT4) {
    widened.resize(2 * R * groups);
    for (int r = 0; r < R; ++r) {
      halves_to_floats(static_cast<const uint16_t*>(sv) + (n0 + r) * groups, widened.data() + r * groups, groups);
      halves_to_floats(z + (n0 + r) * groups, widened.data() + (R + r) * groups, groups);
    }
    sc = widened.data();
    zc = sc + R * groups;
  } else {
    sc = static_cast<const float*>(sv) + n0 * groups;
  }
  vacc acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = acc_zero();
  const int64_t block_bytes = INT4 ? SUB / 2 : SUB;  // packed bytes per sub-block
  const char* rows = static_cast<const char*>(qv) + n0 * blocks * block_bytes;
  const char* ahead = rows + PREFETCH_TILES * R * blocks * block_bytes;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = b / per_group;
    for (int r = 0; r < R; ++r) {
      prefetch(ahead + (b * R + r) * block_bytes);
      const float scale = per_row ? 1.f : sc[r * groups + g];
      const char* wb = rows + (r * blocks + b) * block_bytes;
      for (int m = 0; m < MT; ++m) {
        const int8_t* xb = xq.q + m * K + b * SUB;
        const vi dot = INT4 ? q4_dot(reinterpret_cast<const uint8_t*>(wb), xb)
                            : q8_dot(reinterpret_cast<const int8_t*>(wb), xb);
        acc[r][m] = acc_add(dot, scale * xq.d[m * blocks + b], acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      float total = acc_sum(acc[r][m]);
      if constexpr (INT4) {
        for (int64_t g = 0; g < groups; ++g) total += zc[r * groups + g] * xq.gsum[m * groups + g];
      }
      if (per_row) total *= sc[r];
      y[m * ldy + n0 + r] = total;
    }
}

template <int MT, bool INT4>
void a8_rows(const QuantX& xq, int64_t m0, int64_t K, int64_t G, int64_t N, const void* q, const void* s,
             const uint16_t* z, float* y) {
  constexpr int R = std::max(1, kA8Accumulators / MT);
  const int64_t blocks = K / SUB;
  const QuantXRows view{xq.q.data() + m0 * K, xq.d.data() + m0 * blocks, xq.gsum.data() + m0 * (K / G)};
  run_tiles(MT, N, R, [&](int64_t n0) { a8_tile<R, MT, INT4>(view, K, G, q, s, z, n0, y + m0 * N, N); },
            [&](int64_t n) { a8_tile<1, MT, INT4>(view, K, G, q, s, z, n, y + m0 * N, N); });
}

template <bool INT4>
void a8_matmul(const QuantX& xq, int64_t M, int64_t K, int64_t G, int64_t N, const void* q, const void* s,
               const uint16_t* z, float* y) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) a8_rows<4, INT4>(xq, m, K, G, N, q, s, z, y);
  for (; m + 2 <= M; m += 2) a8_rows<2, INT4>(xq, m, K, G, N, q, s, z, y);
  for (; m < M; ++m) a8_rows<1, INT4>(xq, m, K, G, N, q, s, z, y);
}

// ---- float weights ----------------------------------------------------------------------------------
// fp32 weights load as they are. bf16 weights load 2*VL at a time as VL 32-bit lanes, each holding an even
// element (low half) and an odd one (high half): the odd ones are the lanes with the low half masked off,
// the even ones the lanes shifted left by 16 - two plain ALU ops per 2*VL weights, no widening shuffles.
// x is read in the matching order (``pair_lanes``: per 2*VL elements, the even ones then the odd ones).
inline void wload2(const float* p, vf& a, vf& b) {
  a = vload(p);
  b = vload(p + VL);
}
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline void wload2(const at::BFloat16* p, vf& even, vf& odd) {
  const __m512i raw = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#elif defined(__AVX2__)
inline void wload2(const at::BFloat16* p, vf& even, vf& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#else
inline void wload2(const at::BFloat16* p, vf& even, vf& odd) {
  even = static_cast<float>(p[0]);
  odd = static_cast<float>(p[1]);
}
#endif

// x [M, K] in the order ``wload2`` gives bf16 weights in, over the SUB-multiple body of each row.
void pair_lanes(const float* x, int64_t M, int64_t K, std::vector<float>& out) {
  const int64_t body = K - K % SUB;
  out.assign(x, x + M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < body; k += 2 * VL)
      for (int j = 0; j < VL; ++j) {
        out[m * K + k + j] = x[m * K + k + 2 * j];
        out[m * K + k + VL + j] = x[m * K + k + 2 * j + 1];
      }
}

// How far ahead of a tile the dense GEMV prefetches: 32 KiB measured best for bf16 (19.0 vs 16.4 GB/s
// without), neutral for fp32 (2 threads, AVX-512 EPYC).
constexpr int64_t kDensePrefetchBytes = 32768;
// R weight rows x MT activation rows, K in steps of SUB (a scalar tail for the rest), fp32 sums.
// x: as pair_lanes orders it for bf16 weights, as it is for fp32; x_tail: x as it is (the tail's columns).
template <int R, int MT, typename w_t>
void dense_tile(const float* x, const float* x_tail, int64_t K, const w_t* w, int64_t n0, float* y, int64_t ldy) {
  vf acc[R][MT][NV];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < NV; ++v) acc[r][m][v] = vzero();
  const w_t* rows = w + n0 * K;
  const char* ahead = reinterpret_cast<const char*>(rows) + kDensePrefetchBytes;
  const int64_t body = K - K % SUB;
  constexpr int64_t kBytes = SUB * sizeof(w_t);
  for (int64_t k = 0; k < body; k += SUB) {
    for (int r = 0; r < R; ++r) {
      const w_t* wr = rows + r * K + k;
      for (int64_t off = 0; off < kBytes; off += 64) prefetch(ahead + (r * K + k) * sizeof(w_t) + off);
      vf wv[NV];
      for (int v = 0; v < NV; v += 2) wload2(wr + v * VL, wv[v], wv[v + 1]);
      for (int m = 0; m < MT; ++m)
        for (int v = 0; v < NV; ++v) acc[r][m][v] = vfma(wv[v], vload(x + m * K + k + v * VL), acc[r][m][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      float total = 0.f;
      for (int v = 0; v < NV; ++v) total += vsum(acc[r][m][v]);
      for (int64_t k = body; k < K; ++k) total += static_cast<float>(rows[r * K + k]) * x_tail[m * K + k];
      y[m * ldy + n0 + r] = total;
    }
}

template <int MT, typename w_t>
void dense_rows(const float* x, const float* x_tail, const w_t* w, int64_t K, int64_t N, float* y) {
  constexpr int R = rows_for<MT>();
  run_tiles(MT, N, R, [&](int64_t n0) { dense_tile<R, MT>(x, x_tail, K, w, n0, y, N); },
            [&](int64_t n) { dense_tile<1, MT>(x, x_tail, K, w, n, y, N); });
}

template <typename w_t>
void dense_all(const float* x, const float* x_tail, const w_t* w, int64_t M, int64_t K, int64_t N, float* y) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dense_rows<4>(x + m * K, x_tail + m * K, w, K, N, y + m * N);
  for (; m + 2 <= M; m += 2) dense_rows<2>(x + m * K, x_tail + m * K, w, K, N, y + m * N);
  for (; m < M; ++m) dense_rows<1>(x + m * K, x_tail + m * K, w, K, N, y + m * N);
}

}  // namespace

std::string isa() { return kIsa; }

torch::Tensor int4_matmul(torch::Tensor x, torch::Tensor q, torch::Tensor scales, torch::Tensor zeros,
                          int64_t group_size) {
  const int64_t N = q.size(0), K = q.size(1) * 2;
  check_int4(q, scales, zeros, group_size, K);
  std::vector<float> xs;
  const float* xp = float_x(x, K, xs);
  const int64_t M = x.size(0);
  Out out(x, M, N);
  const auto* qp = q.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* zp = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::Half>());
  float* yp = out.data;
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) q4_rows<4>(xp + m * K, qp, sp, zp, K, group_size, N, yp + m * N);
  for (; m + 2 <= M; m += 2) q4_rows<2>(xp + m * K, qp, sp, zp, K, group_size, N, yp + m * N);
  for (; m < M; ++m) q4_rows<1>(xp + m * K, qp, sp, zp, K, group_size, N, yp + m * N);
  return out.finish();
}

torch::Tensor int8_matmul(torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t group_size) {
  const int64_t N = q.size(0), K = q.size(1);
  check_int8(q, scales, group_size, K);
  std::vector<float> xs;
  const float* xp = float_x(x, K, xs);
  const int64_t M = x.size(0);
  Out out(x, M, N);
  const auto* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = out.data;
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) q8_rows<4>(xp + m * K, qp, sp, K, group_size, N, yp + m * N);
  for (; m + 2 <= M; m += 2) q8_rows<2>(xp + m * K, qp, sp, K, group_size, N, yp + m * N);
  for (; m < M; ++m) q8_rows<1>(xp + m * K, qp, sp, K, group_size, N, yp + m * N);
  return out.finish();
}

// Rows [row0, row1) of the weight in the activation dtype (fp32 or bf16), [row1 - row0, K]: large batches
// multiply it with torch's GEMM a cache-sized slice at a time, so the packed bytes are still what is
// streamed from DRAM.
template <typename out_t, typename Unpack>
void dequantize_rows(int64_t K, int64_t row0, int64_t row1, out_t* op, Unpack unpack) {
  at::parallel_for(row0, row1, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      out_t* o = op + (n - row0) * K;
      for (int64_t k = 0; k < K; k += SUB) unpack(n, k, o + k);
    }
  });
}

template <typename Unpack>
torch::Tensor dequantize_into(const torch::Tensor& like, int64_t row0, int64_t row1, int64_t K, at::ScalarType dtype,
                              Unpack unpack) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize: float32 or bfloat16 output");
  auto out = torch::empty({row1 - row0, K}, like.options().dtype(dtype));
  if (dtype == at::kFloat) {
    dequantize_rows(K, row0, row1, out.data_ptr<float>(), unpack);
  } else {
    dequantize_rows(K, row0, row1, out.data_ptr<at::BFloat16>(), unpack);
  }
  return out;
}

torch::Tensor int4_dequantize(torch::Tensor q, torch::Tensor scales, torch::Tensor zeros, int64_t group_size,
                              int64_t row0, int64_t row1, at::ScalarType dtype) {
  const int64_t K = q.size(1) * 2, groups = K / group_size;
  TORCH_CHECK(0 <= row0 && row0 <= row1 && row1 <= q.size(0), "row range out of bounds");
  const auto* qp = q.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* zp = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::Half>());
  return dequantize_into(q, row0, row1, K, dtype, [&](int64_t n, int64_t k, auto* out) {
    const int64_t g = n * groups + k / group_size;
    const vf sc = vset1(half_to_float(sp[g])), zc = vset1(half_to_float(zp[g]));
    vf w[NV];
    unpack_q4(qp + n * (K / 2) + k / 2, w);
    for (int v = 0; v < NV; ++v) vstore(out + v * VL, vfma(w[v], sc, zc));
  });
}

torch::Tensor int8_dequantize(torch::Tensor q, torch::Tensor scales, int64_t group_size, int64_t row0,
                              int64_t row1, at::ScalarType dtype) {
  const int64_t K = q.size(1), groups = K / group_size;
  TORCH_CHECK(0 <= row0 && row0 <= row1 && row1 <= q.size(0), "row range out of bounds");
  const auto* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  return dequantize_into(q, row0, row1, K, dtype, [&](int64_t n, int64_t k, auto* out) {
    const vf sc = vset1(sp[n * groups + k / group_size]);
    vf w[NV];
    unpack_q8(qp + n * K + k, w);
    for (int v = 0; v < NV; ++v) vstore(out + v * VL, vmul(w[v], sc));
  });
}

torch::Tensor int4_matmul_a8(torch::Tensor x, torch::Tensor q, torch::Tensor scales, torch::Tensor zeros,
                             int64_t group_size) {
  const int64_t N = q.size(0), K = q.size(1) * 2, M = x.size(0);
  check_int4(q, scales, zeros, group_size, K);
  std::vector<float> xs;
  QuantX xq;
  quantize_x(float_x(x, K, xs), M, K, group_size, xq);
  Out out(x, M, N);
  a8_matmul<true>(xq, M, K, group_size, N, q.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                  reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::Half>()), out.data);
  return out.finish();
}

torch::Tensor int8_matmul_a8(torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t group_size) {
  const int64_t N = q.size(0), K = q.size(1), M = x.size(0);
  check_int8(q, scales, group_size, K);
  std::vector<float> xs;
  QuantX xq;
  quantize_x(float_x(x, K, xs), M, K, group_size, xq);
  Out out(x, M, N);
  a8_matmul<false>(xq, M, K, group_size, N, q.data_ptr<int8_t>(), scales.data_ptr<float>(), nullptr, out.data);
  return out.finish();
}

torch::Tensor dense_matmul(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "w must be a contiguous [N, K] tensor");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "w must be float32 or bfloat16");
  const int64_t N = w.size(0), K = w.size(1);
  std::vector<float> xs;
  const float* xp = float_x(x, K, xs);
  const int64_t M = x.size(0);
  Out out(x, M, N);
  if (w.scalar_type() == at::kFloat) {
    dense_all(xp, xp, w.data_ptr<float>(), M, K, N, out.data);
  } else {
    std::vector<float> lanes;
    pair_lanes(xp, M, K, lanes);
    dense_all(lanes.data(), xp, w.data_ptr<at::BFloat16>(), M, K, N, out.data);
  }
  return out.finish();
}
