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
#if defined(__AVX2__)
#include <immintrin.h>
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

// Grain: rows per task, so a batch-1 step does not pay for waking threads.
constexpr int64_t kGrain = 16;

// residual += x (rounded to the dtype, as `x + residual` is); out = weight * dtype(norm(residual)).
// x, residual, out: [n, h] contiguous rows; weight [h]. With add=false residual is only read.
template <typename C, typename T = typename C::storage>
void add_rms_norm_impl(const T* x, T* residual, const T* w, T* out, int64_t n, int64_t h, float eps, bool add) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* res = residual + r * h;
      const T* xr = x + r * h;
      T* o = out + r * h;
      float ss = 0.f;
      if (add) {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < h; ++i) {
          const float s = C::in(C::out(C::in(xr[i]) + C::in(res[i])));  // rounded, as `x + residual` is
          res[i] = C::out(s);
          ss += s * s;
        }
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < h; ++i) ss += C::in(res[i]) * C::in(res[i]);
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) {
        const float normed = C::in(C::out(C::in(res[i]) * inv));
        o[i] = C::out(C::in(w[i]) * normed);
      }
    }
  });
}

// out[r, i] = dtype(silu(gate)) * up, gate_up: [n, 2 * inter] (gate first), out: [n, inter].
template <typename C, typename T = typename C::storage>
void silu_mul_impl(const T* gu, T* out, int64_t n, int64_t inter, int64_t gu_stride) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * gu_stride;
      const T* u = g + inter;
      T* o = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
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
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos_sin + positions[r] * D;
      const T* s = c + half;
      for (int64_t hd = 0; hd < heads; ++hd) {
        T* x1 = x + r * row_stride + hd * D;
        T* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
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
