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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

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

// x: contiguous [M, K], fp32 or bf16 -> fp32 (bf16 widened here: one ATen call, no Python round trip).
torch::Tensor float_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  return x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
}

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

}  // namespace

std::string isa() { return kIsa; }

torch::Tensor int4_matmul(torch::Tensor x, torch::Tensor q, torch::Tensor scales, torch::Tensor zeros,
                          int64_t group_size) {
  const int64_t N = q.size(0), K = q.size(1) * 2;
  const auto x32 = float_x(x, K);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous(), "q must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(group_size % SUB == 0 && K % group_size == 0, "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && zeros.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  zeros.is_contiguous() && scales.numel() == N * (K / group_size) && zeros.numel() == scales.numel(),
              "scales, zeros must be contiguous fp16 [N, K/group_size]");
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x32.options());
  const auto* qp = q.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* zp = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::Half>());
  const float* xp = x32.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) q4_rows<4>(xp + m * K, qp, sp, zp, K, group_size, N, yp + m * N);
  for (; m + 2 <= M; m += 2) q4_rows<2>(xp + m * K, qp, sp, zp, K, group_size, N, yp + m * N);
  for (; m < M; ++m) q4_rows<1>(xp + m * K, qp, sp, zp, K, group_size, N, yp + m * N);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

torch::Tensor int8_matmul(torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t group_size) {
  const int64_t N = q.size(0), K = q.size(1);
  const auto x32 = float_x(x, K);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "q must be contiguous int8 [N, K]");
  TORCH_CHECK(group_size % SUB == 0 && K % group_size == 0, "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / group_size),
              "scales must be contiguous fp32 [N, K/group_size]");
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x32.options());
  const auto* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* xp = x32.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) q8_rows<4>(xp + m * K, qp, sp, K, group_size, N, yp + m * N);
  for (; m + 2 <= M; m += 2) q8_rows<2>(xp + m * K, qp, sp, K, group_size, N, yp + m * N);
  for (; m < M; ++m) q8_rows<1>(xp + m * K, qp, sp, K, group_size, N, yp + m * N);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
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
