// Fused elementwise ops of a Llama decoder layer on CPU: one pass over the activations where the eager
// path makes two to six (and allocates as many temporaries). The eager ops in common/model/fused_ops.py
// are the reference; these kernels round to the activation dtype at the same points the eager path does
// (so bf16 results differ only by summation order and exp), and accumulate in fp32.
//
// Rows (tokens) are split over torch's intra-op threads; within a row the loops are plain and
// `omp simd`, vectorised by the compiler for the instruction set named by the module's build flags.
// torch: common/kernels/cpu/kernel_api.h, which common/kernels/build.py puts first
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__linux__) && defined(__GNUC__)
#include <cpuid.h>
#endif

namespace {

// Storage <-> fp32 conversions the compiler can vectorise. bf16 is the top half of an fp32, rounded to
// nearest even exactly as c10::BFloat16 rounds (whose own conversion is an opaque scalar call).
struct F32 {
  using storage = float;
  static inline float in(float v) { return v; }
  static inline float out(float v) { return v; }
};
struct BF16 {
  using storage = uint16_t;
  static inline float in(uint16_t v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline uint16_t out(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return f != f ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
  }
};
struct F16 {
  using storage = at::Half;
  static inline float in(at::Half v) { return static_cast<float>(v); }
  static inline at::Half out(float v) { return static_cast<at::Half>(v); }
};

// exp(x) for fp32 in a form that vectorises (Cephes' expf: range reduction by ln 2, degree-5
// polynomial, exponent by bit shift); within 2 ulp of libm over the clamped range.
inline float exp_f32(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  // round to nearest by adding and removing 1.5 * 2^23 (plain adds: vectorise without -ffast-math)
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

// The same math in explicit vector registers, for the bf16 / fp32 rows of a prefill step (thousands of rows a
// step): GCC's vectorisation of the plain loops above (if-converted masks around exp's clamp, three divides a
// vector) ran silu_mul at ~3.5 cycles an element, slower than eager torch (session 30: 2,048 x 1,536 bf16 2.3 ms
// vs 1.7 ms eager, 0.7 ms a copy of its input). Same rounding points as the scalar code: `rnd` is C::in(C::out(.))
// and `store` rounds as C::out; fp16 and the generic build keep the scalar loops.
#if defined(__AVX512F__) || defined(__AVX2__)
#define TF_VEC 1
#if defined(__AVX512F__)
using vf = __m512;
using vi = __m512i;
constexpr int64_t kW = 16;
inline vf v_set(float v) { return _mm512_set1_ps(v); }
inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
// 1 / a: the 14-bit estimate and one Newton step (~23 bits; a divide is 10-16 cycles a vector on port 0)
inline vf v_recip(vf a) {
  const vf r = _mm512_rcp14_ps(a);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(a, r, _mm512_set1_ps(2.f)));
}
inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf v_min(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf v_max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf v_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float v_sum(vf a) { return _mm512_reduce_add_ps(a); }
inline vf v_load(const float* p) { return _mm512_loadu_ps(p); }
inline void v_store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf v_load(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
// bf16 bits of each lane in the low half of a 32-bit lane: round to nearest even, NaN -> 0x7FC0 (BF16::out).
inline vi v_bf16_bits(vf f) {
  const vi u = _mm512_castps_si512(f);
  const vi lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const vi r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
inline void v_store(uint16_t* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(v_bf16_bits(v)));
}
inline vf v_rnd_bf16(vf v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v_bf16_bits(v), 16)); }
inline vf v_pow2(vf n) {  // 2^n for integral n in fp32's exponent range
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#else
using vf = __m256;
using vi = __m256i;
constexpr int64_t kW = 8;
inline vf v_set(float v) { return _mm256_set1_ps(v); }
inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf v_recip(vf a) {  // the 12-bit estimate and one Newton step (~23 bits)
  const vf r = _mm256_rcp_ps(a);
  return _mm256_mul_ps(r, _mm256_fnmadd_ps(a, r, _mm256_set1_ps(2.f)));
}
inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf v_min(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf v_max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf v_round(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float v_sum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf v_load(const float* p) { return _mm256_loadu_ps(p); }
inline void v_store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf v_load(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline vi v_bf16_bits(vf f) {
  const vi u = _mm256_castps_si256(f);
  const vi lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const vi r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const vi nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
inline void v_store(uint16_t* p, vf v) {
  const vi b = v_bf16_bits(v);  // eight 16-bit values in 32-bit lanes: pack, then the two lanes' halves together
  const vi packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline vf v_rnd_bf16(vf v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v_bf16_bits(v), 16)); }
inline vf v_pow2(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#endif
// C::in(C::out(v)): the rounding to the storage dtype, as a float.
template <typename C> inline vf v_rnd(vf v) {
  if constexpr (std::is_same_v<C, BF16>) return v_rnd_bf16(v); else return v;
}
// exp_f32, lane by lane.
inline vf v_exp(vf x) {
  x = v_min(v_max(x, v_set(-87.3f)), v_set(88.3f));
  const vf n = v_round(v_mul(x, v_set(1.44269504088896341f)));
  vf r = v_fma(n, v_set(-0.693359375f), x);
  r = v_fma(n, v_set(2.12194440e-4f), r);
  vf p = v_set(1.9875691500e-4f);
  p = v_fma(p, r, v_set(1.3981999507e-3f));
  p = v_fma(p, r, v_set(8.3334519073e-3f));
  p = v_fma(p, r, v_set(4.1665795894e-2f));
  p = v_fma(p, r, v_set(1.6666665459e-1f));
  p = v_fma(p, r, v_set(5.0000001201e-1f));
  const vf y = v_add(v_fma(v_mul(p, r), r, r), v_set(1.f));
  return v_mul(y, v_pow2(n));
}
// fp32 and bf16 rows take the vector loops; fp16 the scalar ones.
template <typename C> constexpr bool kVec = std::is_same_v<C, F32> || std::is_same_v<C, BF16>;
#else
template <typename C> constexpr bool kVec = false;
#endif

// SiLU x up's bf16 rows with the CPU's own round-to-nearest-even conversion (AVX512-BF16 ``vcvtneps2bf16``) where
// it has one: the software rounding above is half of the row's work (session 30, 2,048 x 1,536 bf16). The same
// rounding points; the instruction reads an input denormal as zero, which a product of bf16 values rounded to
// bf16 next changes by less than the rounding itself.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__linux__) && defined(__GNUC__) && \
    (__GNUC__ >= 11 || defined(__clang__))
#define TF_BF16_NATIVE 1
inline bool cpu_has_avx512bf16() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    return ((a >> 5) & 1u) != 0;  // CPUID.(7,1):EAX AVX512_BF16
  }();
  return has;
}
#pragma GCC push_options
#pragma GCC target("avx512bf16")
// C::in(C::out(v)) and a store rounding as C::out, by `vcvtneps2bf16`: SiLU x up's, add + RMSNorm's and rotary's
// rows (their software rounding was half or more of their work: 2,048 x 576 add + RMSNorm 0.35 ms, a copy of x 0.08).
inline vf v_rnd_native(vf v) {
  const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
inline void v_store_native(uint16_t* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
// exp(x) as 2^n * 2^f, n = round(x log2 e): f from one fused multiply-subtract and log2 e's low part (~1e-7
// absolute), 2^f by a degree-6 polynomial (its Taylor terms in f ln 2: within 1.2e-7 on [-0.5, 0.5]), 2^n by
// `vscalefps`: 13 instructions where v_exp takes 17; above 88.3 clamped as v_exp is (1 / (1 + e) stays finite).
inline vf v_exp_scalef(vf x) {
  x = _mm512_min_ps(x, v_set(88.3f));
  const vf n = _mm512_roundscale_ps(v_mul(x, v_set(1.44269502f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf f = _mm512_fmsub_ps(x, v_set(1.44269502f), n);
  f = v_fma(x, v_set(1.92596299e-8f), f);  // log2 e - 1.44269502f
  vf p = v_set(1.5403530393381608e-4f);
  p = v_fma(p, f, v_set(1.3333558146428443e-3f));
  p = v_fma(p, f, v_set(9.6181291076284772e-3f));
  p = v_fma(p, f, v_set(5.5504108664821580e-2f));
  p = v_fma(p, f, v_set(2.4022650695910071e-1f));
  p = v_fma(p, f, v_set(6.9314718055994531e-1f));
  p = v_fma(p, f, v_set(1.f));
  return _mm512_scalef_ps(p, n);
}
// One row's vector part (16 columns at a time); returns where the scalar tail starts.
inline int64_t silu_mul_row_bf16_native(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t inter) {
  const vf one = v_set(1.f), zero = v_set(0.f);
  int64_t i = 0;
  for (; i + kW <= inter; i += kW) {
    const vf gv = v_load(g + i);
    const vf silu = v_rnd_native(v_mul(gv, v_recip(v_add(one, v_exp_scalef(v_sub(zero, gv))))));
    v_store_native(o + i, v_mul(silu, v_load(u + i)));
  }
  return i;
}
// One row of add_rms_norm_impl for h a multiple of kW.
inline void add_rms_row_bf16_native(const uint16_t* xr, uint16_t* res, const uint16_t* w, uint16_t* o, int64_t h,
                                    float eps, bool add) {
  vf acc = v_set(0.f);
  for (int64_t i = 0; i < h; i += kW) {
    vf sv = v_load(res + i);
    if (add) {
      sv = v_rnd_native(v_add(v_load(xr + i), sv));
      v_store_native(res + i, sv);
    }
    acc = v_fma(sv, sv, acc);
  }
  const vf vinv = v_set(1.f / std::sqrt(v_sum(acc) / static_cast<float>(h) + eps));
  for (int64_t i = 0; i < h; i += kW) {
    v_store_native(o + i, v_mul(v_load(w + i), v_rnd_native(v_mul(v_load(res + i), vinv))));
  }
}
// rotary_impl's vector part of one head; returns where the scalar tail starts.
inline int64_t rotary_row_bf16_native(uint16_t* x1, uint16_t* x2, const uint16_t* c, const uint16_t* s, int64_t half) {
  int64_t i = 0;
  for (; i + kW <= half; i += kW) {
    const vf a = v_load(x1 + i), b = v_load(x2 + i), cv = v_load(c + i), sv = v_load(s + i);
    v_store_native(x1 + i, v_sub(v_rnd_native(v_mul(a, cv)), v_rnd_native(v_mul(b, sv))));
    v_store_native(x2 + i, v_add(v_rnd_native(v_mul(b, cv)), v_rnd_native(v_mul(a, sv))));
  }
  return i;
}
#pragma GCC pop_options
#endif

// Grain: rows per task, so a batch-1 step does not pay for waking threads.
constexpr int64_t kGrain = 16;

// residual += x (rounded to the dtype, as `x + residual` is); out = weight * dtype(norm(residual)).
// x, residual, out: [n, h] contiguous rows; weight [h]. With add=false residual is only read.
template <typename C, typename T = typename C::storage>
void add_rms_norm_impl(const T* x, T* residual, const T* w, T* out, int64_t n, int64_t h, float eps, bool add) {
#if defined(TF_BF16_NATIVE)
  const bool native = std::is_same_v<C, BF16> && h % kW == 0 && cpu_has_avx512bf16();
#endif
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* res = residual + r * h;
      const T* xr = x + r * h;
      T* o = out + r * h;
#if defined(TF_BF16_NATIVE)
      if constexpr (std::is_same_v<C, BF16>) {
        if (native) {
          add_rms_row_bf16_native(xr, res, w, o, h, eps, add);
          continue;
        }
      }
#endif
      float ss = 0.f;
      int64_t i = 0;
#if defined(TF_VEC)
      if constexpr (kVec<C>) {
        vf acc = v_set(0.f);
        for (; i + kW <= h; i += kW) {
          vf sv = v_load(res + i);
          if (add) {
            sv = v_rnd<C>(v_add(v_load(xr + i), sv));
            v_store(res + i, sv);
          }
          acc = v_fma(sv, sv, acc);
        }
        ss = v_sum(acc);
      }
#endif
      if (add) {
#pragma omp simd reduction(+ : ss)
        for (int64_t j = i; j < h; ++j) {
          const float s = C::in(C::out(C::in(xr[j]) + C::in(res[j])));  // rounded, as `x + residual` is
          res[j] = C::out(s);
          ss += s * s;
        }
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t j = i; j < h; ++j) ss += C::in(res[j]) * C::in(res[j]);
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
      i = 0;
#if defined(TF_VEC)
      if constexpr (kVec<C>) {
        const vf vinv = v_set(inv);
        for (; i + kW <= h; i += kW) v_store(o + i, v_mul(v_load(w + i), v_rnd<C>(v_mul(v_load(res + i), vinv))));
      }
#endif
#pragma omp simd
      for (int64_t j = i; j < h; ++j) {
        const float normed = C::in(C::out(C::in(res[j]) * inv));
        o[j] = C::out(C::in(w[j]) * normed);
      }
    }
  });
}

// out[r, i] = dtype(silu(gate)) * up, gate_up: [n, 2 * inter] (gate first), out: [n, inter].
template <typename C, typename T = typename C::storage>
void silu_mul_impl(const T* gu, T* out, int64_t n, int64_t inter, int64_t gu_stride) {
#if defined(TF_BF16_NATIVE)
  const bool native = std::is_same_v<C, BF16> && cpu_has_avx512bf16();
#endif
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * gu_stride;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
#if defined(TF_BF16_NATIVE)
      if constexpr (std::is_same_v<C, BF16>) {
        if (native) i = silu_mul_row_bf16_native(g, u, o, inter);
      }
#endif
#if defined(TF_VEC)
      if constexpr (kVec<C>) {
        const vf one = v_set(1.f), zero = v_set(0.f);
        for (; i + kW <= inter; i += kW) {
          const vf gv = v_load(g + i);
          const vf s = v_rnd<C>(v_mul(gv, v_recip(v_add(one, v_exp(v_sub(zero, gv))))));
          v_store(o + i, v_mul(s, v_load(u + i)));
        }
      }
#endif
      for (; i < inter; ++i) {
        const float gv = C::in(g[i]);
        const float s = C::in(C::out(gv / (1.f + exp_f32(-gv))));
        o[i] = C::out(s * C::in(u[i]));
      }
    }
  });
}

// In place, half-split ("rotate_half") rotary over the heads of one row: x1' = x1 c - x2 s, x2' = x2 c + x1 s.
// x: [n, heads, D] with row stride `row_stride` and unit head stride D; cos_sin: [P, D] = cat(cos, sin).
template <typename C, typename T = typename C::storage>
void rotary_impl(T* x, int64_t n, int64_t heads, int64_t D, int64_t row_stride, const T* cos_sin,
                 const int64_t* positions) {
  const int64_t half = D / 2;
#if defined(TF_BF16_NATIVE)
  const bool native = std::is_same_v<C, BF16> && cpu_has_avx512bf16();
#endif
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos_sin + positions[r] * D;
      const T* s = c + half;
      for (int64_t hd = 0; hd < heads; ++hd) {
        T* x1 = x + r * row_stride + hd * D;
        T* x2 = x1 + half;
        int64_t i = 0;
#if defined(TF_BF16_NATIVE)
        if constexpr (std::is_same_v<C, BF16>) {
          if (native) i = rotary_row_bf16_native(x1, x2, c, s, half);
        }
#endif
#if defined(TF_VEC)
        if constexpr (kVec<C>) {
          for (; i + kW <= half; i += kW) {
            const vf a = v_load(x1 + i), b = v_load(x2 + i), cv = v_load(c + i), sv = v_load(s + i);
            v_store(x1 + i, v_sub(v_rnd<C>(v_mul(a, cv)), v_rnd<C>(v_mul(b, sv))));
            v_store(x2 + i, v_add(v_rnd<C>(v_mul(b, cv)), v_rnd<C>(v_mul(a, sv))));
          }
        }
#endif
        for (; i < half; ++i) {
          const float a = C::in(x1[i]), b = C::in(x2[i]), cv = C::in(c[i]), sv = C::in(s[i]);
          // The eager path rounds each product to the dtype before the sum; so do we.
          x1[i] = C::out(C::in(C::out(a * cv)) - C::in(C::out(b * sv)));
          x2[i] = C::out(C::in(C::out(b * cv)) + C::in(C::out(a * sv)));
        }
      }
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.stride(0) == t.size(1), name, " must be contiguous [n, h]");
}

// Calls fn.template operator()<Traits>() for the tensor's dtype.
template <typename Fn>
void dispatch(const torch::Tensor& t, Fn&& fn) {
  switch (t.scalar_type()) {
    case at::kFloat: fn(F32{}); break;
    case at::kBFloat16: fn(BF16{}); break;
    case at::kHalf: fn(F16{}); break;
    default: TORCH_CHECK(false, "fused ops support float32, bfloat16 and float16, not ", t.scalar_type());
  }
}

template <typename C>
typename C::storage* ptr(const torch::Tensor& t) { return reinterpret_cast<typename C::storage*>(t.data_ptr()); }

}  // namespace

// Returns out; residual is updated in place when add is true.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps, bool add) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.dtype() == residual.dtype() && weight.dtype() == x.dtype(),
              "x, residual and weight must agree in shape and dtype");
  auto w = weight.contiguous();
  auto out = torch::empty_like(x);
  const int64_t n = x.size(0), h = x.size(1);
  dispatch(x, [&](auto traits) {
    using C = decltype(traits);
    add_rms_norm_impl<C>(ptr<C>(x), ptr<C>(residual), ptr<C>(w), ptr<C>(out), n, h, static_cast<float>(eps), add);
  });
  return out;
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.stride(1) == 1, "gate_up: [n, 2 * inter]");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({n, inter}, gate_up.options());
  dispatch(gate_up, [&](auto traits) {
    using C = decltype(traits);
    silu_mul_impl<C>(ptr<C>(gate_up), ptr<C>(out), n, inter, gate_up.stride(0));
  });
  return out;
}

// q: [n, H, D], k: [n, Hkv, D] (views into the qkv projection's output: any row stride, unit head stride D).
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos_sin, torch::Tensor positions) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && k.dim() == 3, "q, k: [n, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2),
              "q, k: unit stride over head_dim, heads adjacent");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.dtype() == q.dtype() && k.dtype() == q.dtype(),
              "cos_sin: contiguous [P, head_dim] of q's dtype");
  auto pos = positions.to(torch::kInt64).contiguous();
  const int64_t n = q.size(0), D = q.size(2);
  dispatch(q, [&](auto traits) {
    using C = decltype(traits);
    rotary_impl<C>(ptr<C>(q), n, q.size(1), D, q.stride(0), ptr<C>(cos_sin), pos.data_ptr<int64_t>());
    rotary_impl<C>(ptr<C>(k), n, k.size(1), D, k.stride(0), ptr<C>(cos_sin), pos.data_ptr<int64_t>());
  });
}

// The paged K/V write of common/kernels/cpu/cpu_kv_write.cpp, compiled into this module after this file
// (common/model/fused_ops.py's sources), so both modules share one definition.
void write_kv(torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor key, torch::Tensor value,
              torch::Tensor slot_mapping);

// rotary_ on q and k, then each token's (rotated) k and its v row into the token's cache slot: what a
// decode layer does between its qkv projection and attention, in one call instead of two. Caches:
// [blocks, block_size, H_kv, D] views (any strides but D's, which is 1), the dtype of k; slot_mapping: [n]
// int64, slot = block * block_size + offset.
void rotary_write_kv_(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos_sin, torch::Tensor positions,
                      torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor slot_mapping) {
  rotary_(q, k, cos_sin, positions);
  write_kv(key_cache, value_cache, k, v, slot_mapping);
}

// The index of each row's largest value, as torch.max(dim=-1).indices: the first maximum; a row holding a
// NaN gives its first NaN. logits: [n, V] fp32 with unit stride over V. Rows split over the threads; a
// row is read once in full (the max, vectorised) and then in blocks of 64 up to the first block holding it.
// Greedy sampling of a 64-row batch of SmolLM2's 49,152 logits: torch's max 1.8-2 ms after a decode
// step (the logits out of cache), this about a third of it.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.stride(1) == 1 && logits.size(1) > 0, "logits: fp32 [n, V], unit stride over V, V > 0");
  const int64_t n = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({n}, logits.options().dtype(at::kLong));
  const float* base = logits.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* v = base + r * stride;
      float m = v[0];
      int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
      for (int64_t i = 0; i < V; ++i) {
        m = v[i] > m ? v[i] : m;  // (std::max here does not vectorise: 7x slower)
        nan |= v[i] != v[i];
      }
      int64_t found = V - 1;
      constexpr int64_t kBlock = 64;
      for (int64_t b = 0; b < V; b += kBlock) {
        const int64_t e = std::min(V, b + kBlock);
        int any = 0;
        if (nan) {
#pragma omp simd reduction(| : any)
          for (int64_t i = b; i < e; ++i) any |= v[i] != v[i];
        } else {
#pragma omp simd reduction(| : any)
          for (int64_t i = b; i < e; ++i) any |= v[i] == m;
        }
        if (!any) continue;
        for (int64_t i = b; i < e; ++i)
          if (nan ? v[i] != v[i] : v[i] == m) {
            found = i;
            break;
          }
        break;
      }
      idx[r] = found;
    }
  });
  return out;
}

// Sampling at a temperature, fused: row r's token is the inverse CDF of softmax(logits[r] / temps[r]) at
// uniforms[r] (in [0, 1)), which is what common/sampling/sampler.py's target_probs + sample_from compute with
// a softmax, an fp64 cumulative sum of the whole [n, V] and a search. Here: the row's max, the exponentials
// into a per-thread buffer (vectorised exp), their sums per 64-entry block in fp64, the block where the running
// sum passes uniform * total, then the entry inside it: no [n, V] fp64 temporary (19 MB at 48 x 49,152), and
// the rows split over threads. The unnormalised weights give the same distribution (the total scales the draw).
// A zero weight is never chosen. temps[r] <= 0, or a row without finite positive mass: the first maximum.
// w[i] = exp(v[i] * inv - m) (exp_f32's math), 0 below -87.3 where fp32's exp is ~0 as in a softmax. The
// compiler keeps exp_f32 scalar in this loop, so AVX2 / AVX-512 builds spell out its 8 lanes (one pass over
// 49,152 logits: ~0.3 ms scalar, a fifth of it vectorised).
inline void exp_weights(const float* v, float* w, int64_t V, float inv, float m) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 vinv = _mm256_set1_ps(inv), vm = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.3f);
  for (; i + 8 <= V; i += 8) {
    const __m256 z = _mm256_fmsub_ps(_mm256_loadu_ps(v + i), vinv, vm);
    const __m256 x = _mm256_max_ps(z, lo);  // z <= 0 here: no upper clamp
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
    _mm256_storeu_ps(w + i, _mm256_and_ps(e, _mm256_cmp_ps(z, lo, _CMP_GE_OQ)));
  }
#endif
  for (; i < V; ++i) {
    const float z = v[i] * inv - m;
    w[i] = z >= -87.3f ? exp_f32(z) : 0.f;
  }
}

torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temps, torch::Tensor uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.stride(1) == 1 && logits.size(1) > 0, "logits: fp32 [n, V], unit stride over V, V > 0");
  const int64_t n = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(temps.scalar_type() == at::kFloat && temps.is_contiguous() && temps.numel() == n, "temps: fp32 [n]");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() && uniforms.numel() == n,
              "uniforms: fp64 [n]");
  auto out = torch::empty({n}, logits.options().dtype(at::kLong));
  auto greedy = argmax_rows(logits);
  const float* base = logits.data_ptr<float>();
  const float* t = temps.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  const int64_t* first_max = greedy.data_ptr<int64_t>();
  int64_t* idx = out.data_ptr<int64_t>();
  constexpr int64_t kBlock = 64;
  const int64_t num_blocks = (V + kBlock - 1) / kBlock;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(V);
    std::vector<double> sums(num_blocks);
    for (int64_t r = begin; r < end; ++r) {
      idx[r] = first_max[r];
      const float temp = t[r];
      const float* v = base + r * stride;
      const float top = v[first_max[r]];
      if (!(temp > 0.f) || !std::isfinite(top)) continue;  // greedy, or NaN / inf logits: the first maximum
      const float inv = 1.f / temp;
      const float m = top * inv;  // multiplying by inv > 0 is monotonic: the max of v * inv
      float* wp = w.data();
      exp_weights(v, wp, V, inv, m);
      double total = 0.0;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t lo = b * kBlock, hi = std::min(V, lo + kBlock);
        double s = 0.0;
#pragma omp simd reduction(+ : s)
        for (int64_t i = lo; i < hi; ++i) s += static_cast<double>(wp[i]);
        sums[b] = s;
        total += s;
      }
      if (!(total > 0.0) || !std::isfinite(total)) continue;
      const double target = u[r] * total;
      double cum = 0.0;
      int64_t b = 0;
      while (b + 1 < num_blocks && cum + sums[b] <= target) cum += sums[b++];
      const int64_t lo = b * kBlock, hi = std::min(V, lo + kBlock);
      int64_t chosen = -1, last_positive = -1;
      for (int64_t i = lo; i < hi; ++i) {
        if (wp[i] <= 0.f) continue;
        last_positive = i;
        cum += static_cast<double>(wp[i]);
        if (cum > target) {
          chosen = i;
          break;
        }
      }
      // Rounding left the draw past the block's entries: its last positive one (the block's sum exceeded it).
      if (chosen < 0) chosen = last_positive;
      if (chosen >= 0) idx[r] = chosen;
    }
  });
  return out;
}
