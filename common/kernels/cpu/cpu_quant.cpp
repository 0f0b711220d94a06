// Weight-only quantized matmuls on CPU: y[M, N] = x[M, K] @ dequant(W)[N, K]^T; x and y fp32 or bf16
// (the sums are fp32 either way).
//
// The packed bytes are read once, widened to fp32 in registers and multiplied against x (cpu_base.cpp has
// the vector layer this file stands on).
//
// Layouts (common/quant/formats.py documents them; the Python reference there is the oracle):
//   int4: q uint8 [N, K/2]; each 32-weight sub-block is 16 bytes, byte j holds weight j in its low nibble
//         and weight j + 16 in its high nibble (GGUF's Q4_1 order); scales, zeros fp16 [N, K/G]:
//         w = scale * q + zero. G is a multiple of 32.
//   int8: q int8 [N, K]; scales fp32 [N, K/G]: w = scale * q (G = K: one scale per output channel).

namespace {

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
