// ``*_matmul_a8``: the products of cpu_quant.cpp with the activations rounded to int8 first, in blocks of 32 with one
// fp32 scale each (as llama.cpp's Q8 activations), so the inner loop is integer dot products of packed
// bytes: ``vpmaddubsw`` + ``vpmaddwd`` on AVX2 and AVX-512 builds (AVX512-VNNI's ``vpdpbusd`` measured no
// faster on Zen 4, and slower for int8 weights), a plain loop otherwise. Per 32 weights that is ~6 instructions instead of ~14, which is what makes a 4-bit GEMV
// stream at memory speed on two cores. ``formats.reference_a8_matmul`` is its math.

namespace {

// x [M, K] -> xq int8 [M, K], per 32-block scale d = max|x| / 127, the block's integer sum sum(xq) and
// d * sum(xq) per weight group (the int4 zero term: the sum of the rounded x, so the result is exactly the
// product with the rounded activations and the rounding of x is not multiplied by the weights' offset).
// Rounding is to nearest even, as torch.round (the vector conversions round in the default MXCSR mode).
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d, gsum;  // [M, K/32] scales; [M, K/G] d * sum(xq) per weight group
  std::vector<int32_t> bsum;  // [M, K/32] sum(xq) per block
};
struct QuantXRows {  // rows m0.. of a QuantX
  const int8_t* q;
  const float *d, *gsum;
};

// One 32-block: writes its 32 int8 values, returns sum(q); d is set to the block's scale.
inline int32_t quantize_block(const float* xb, int8_t* qb, float& d) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  d = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb2 = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(qb2));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb2));
#elif defined(__AVX2__)
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  d = amax / 127.f;
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
#else
  float amax = 0.f;
  for (int j = 0; j < SUB; ++j) amax = std::max(amax, std::fabs(xb[j]));
  d = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t total = 0;
  for (int j = 0; j < SUB; ++j) {
    qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
    total += qb[j];
  }
  return total;
#endif
}

void quantize_x(const float* x, int64_t M, int64_t K, int64_t G, QuantX& out) {
  const int64_t blocks = K / SUB, per_group = G / SUB, n = M * blocks;
  out.q.resize(M * K);
  out.d.resize(n);
  out.bsum.resize(n);
  out.gsum.assign(M * (K / G), 0.f);
  const auto body = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) out.bsum[b] = quantize_block(x + b * SUB, out.q.data() + b * SUB, out.d[b]);
  };
  if (n >= 2048) at::parallel_for(0, n, 512, body); else body(0, n);
  for (int64_t b = 0; b < n; ++b)  // blocks of a row never straddle rows: G | K
    out.gsum[b / per_group] += out.d[b] * static_cast<float>(out.bsum[b]);
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

}  // namespace

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
