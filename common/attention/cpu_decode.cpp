// Paged decode attention on CPU: one query token per sequence, read straight from the paged KV cache.
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
// int64 (the metadata's own int32 tensor is read as it is: no conversion per layer).
//
// ``write_kv`` scatters new tokens' K/V into their slots: one call per layer instead of the index
// arithmetic and two advanced-indexing writes of the PyTorch path (eight dispatches).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
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

// Softmax of one row in place, fp32 (exp vectorised by the compiler's vector math library).
inline void softmax_row(float* r, int64_t len) {
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
}

template <typename scalar_t>
void decode_sequences(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t kstride[3],
                      const int64_t vstride[3], const int32_t* tables, int64_t table_stride, const int64_t* lens,
                      scalar_t* out, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale,
                      int64_t begin, int64_t end) {
  const int64_t G = H / Hkv;
  std::vector<float> qf(H * D), acc(H * D), row(D), scores;
  for (int64_t s = begin; s < end; ++s) {
    const int64_t len = lens[s];
    const int32_t* table = tables + s * table_stride;
    scores.resize(H * len);  // scores[head * len + t]
    to_float(q + s * H * D, qf.data(), H * D);
    for (int64_t i = 0; i < H * D; ++i) qf[i] *= scale;
    // Pass 1: scores = q . k for every head and cached token, block by block (no division per token);
    // a token's K rows for all KV heads are adjacent in the cache.
    for (int64_t start = 0; start < len; start += block_size) {
      const int64_t stop = std::min(start + block_size, len);
      const scalar_t* kp = kc + table[start / block_size] * kstride[0];
      for (int64_t t = start; t < stop; ++t, kp += kstride[1]) {
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
    for (int64_t start = 0; start < len; start += block_size) {
      const int64_t stop = std::min(start + block_size, len);
      const scalar_t* vp = vc + table[start / block_size] * vstride[0];
      for (int64_t t = start; t < stop; ++t, vp += vstride[1]) {
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

}  // namespace

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
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
      decode_sequences<scalar_t>(q, kc, vc, kstride, vstride, tables, block_tables.stride(0), lens.data(), o, H, Hkv, D,
                             block_size, static_cast<float>(scale), begin, end);
    });
  });
  return out;
}

// key, value: [T, H_kv, D] (any strides over tokens and heads, unit over D), the caches' dtype;
// slot_mapping: [T] int64, slot = block * block_size + offset.
void write_kv(torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor key, torch::Tensor value,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4, "caches must be [blocks, block_size, H_kv, D]");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(0) == slot_mapping.size(0) &&
                  value.sizes() == key.sizes(), "key, value: [T, H_kv, D], one slot each");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type() &&
                  key_cache.scalar_type() == value_cache.scalar_type(), "write_kv: K/V and caches share a dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "write_kv: unit stride over D");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(), "slot_mapping: int64");
  const int64_t T = key.size(0), Hkv = key.size(1), D = key.size(2);
  const int64_t block_size = key_cache.size(1), num_blocks = key_cache.size(0);
  TORCH_CHECK(key_cache.size(2) == Hkv && key_cache.size(3) == D, "write_kv: heads or head_dim do not match");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t elem = key.element_size();
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    TORCH_CHECK(slots[t] >= 0 && block < num_blocks, "write_kv: slot ", slots[t], " is outside the cache");
    for (int64_t h = 0; h < Hkv; ++h) {
      std::memcpy(kc + (block * key_cache.stride(0) + offset * key_cache.stride(1) + h * key_cache.stride(2)) * elem,
                  kp + (t * key.stride(0) + h * key.stride(1)) * elem, D * elem);
      std::memcpy(vc + (block * value_cache.stride(0) + offset * value_cache.stride(1) + h * value_cache.stride(2)) * elem,
                  vp + (t * value.stride(0) + h * value.stride(1)) * elem, D * elem);
    }
  }
}
