// The layer every compiled CPU kernel of ``tandem_cpu_<isa>`` stands on: the instruction set's vector
// primitives, the row tiling shared by the GEMVs, x read as fp32 and the output written in x's dtype.
// The module is this file followed by cpu_quant.cpp (weight-only int4/int8 with float activations, and
// dequantization), cpu_quant_a8.cpp (int4/int8 on int8-rounded activations) and cpu_gemv.cpp (float
// weights), concatenated in that order into one translation unit (common/kernels/cpu/__init__.py).
//
// The same sources are compiled once per instruction set (-mavx512f..., -mavx2 -mfma, or plain C++) into
// separate extension modules; common/kernels/cpu/__init__.py picks one at run time from the CPU's flags.
// At decode batch sizes a linear layer is bound by streaming its weights from DRAM, so every GEMV reads the
// weights once, widens them in registers and multiply-adds against x (held in L1).

// torch: common/kernels/cpu/kernel_api.h, which common/kernels/build.py puts first
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <memory>
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

// A kernel's output: fp32 sums written to ``data`` (every element, so the scratch needs no zeroing), then
// ``finish`` rounds them into y when y is bf16. ``float_out``: y is fp32 whatever x is (the LM head's
// logits, which sampling wants in fp32: no bf16 rounding and no second pass to widen them).
struct Out {
  torch::Tensor y;
  std::unique_ptr<float[]> scratch;
  float* data;
  Out(const torch::Tensor& x, int64_t M, int64_t N, bool float_out = false)
      : y(torch::empty({M, N}, float_out ? x.options().dtype(at::kFloat) : x.options())) {
    if (y.scalar_type() == at::kFloat) {
      data = y.data_ptr<float>();
    } else {
      scratch.reset(new float[M * N]);
      data = scratch.get();
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

}  // namespace

std::string isa() { return kIsa; }
