// ``moe_experts``: a mixture of experts' routed tokens through their experts in one call (common/model/moe.py's
// ``PanelExperts``), on the float 16-row panels of cpu_gemv.cpp.
//
//   x       [T, H] fp32 or bf16: the layer's normed hidden states
//   token   [n] int64: the token of each (token, expert) pair, the pairs sorted by expert (stable)
//   weight  [n] fp32: each pair's routing weight
//   offsets [E + 1] int64: expert e's pairs are offsets[e] .. offsets[e + 1]
//   w13     each expert's gate rows then up rows [2I, H] as panels: fp32 [E, 2I/16, H, 16] or
//           bf16 [E, 2I/16, H/2, 16, 2]
//   w2      each expert's down projection [H, I] as panels: fp32 [E, H/16, I, 16] or bf16 [E, H/16, I/2, 16, 2]
//   -> out  [T, H] in x's dtype: per token, the sum over its pairs of weight * down(silu(gate) * up)
//
// Three passes, each split over threads by (expert, panel): the gate/up panels of every hit expert times that
// expert's rows, silu(gate) * up per row, then the down panels. Each expert's weights are read once per call
// whatever its number of rows (every row group of an expert multiplies a panel while it is in cache); experts
// no token chose are not read at all. The weighted sum runs last, on one thread, in the pairs' order: each
// token's contributions are added in ascending expert order, as transformers' loop adds them.

namespace {

// rows [m0, m1) of xs (K columns) times panel p of one expert's panels ``w``, into y (N columns).
template <bool BF16>
void expert_panel(const float* xs, int64_t m0, int64_t m1, int64_t K, const void* w, float* y, int64_t N, int64_t p) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) dense_panel_tile_fma<4, BF16>(xs + m * K, K, w, y + m * N, N, p);
  for (; m < m1; ++m) dense_panel_tile_fma<1, BF16>(xs + m * K, K, w, y + m * N, N, p);
}

// Every (hit expert, panel) item of one projection: N output rows (N / 16 panels) over K inputs.
template <bool BF16>
void experts_pass(const float* xs, const int64_t* offsets, int64_t E, int64_t K, int64_t N, const char* w,
                  int64_t expert_bytes, float* y) {
  const int64_t panels = N / kDensePanel;
  at::parallel_for(0, E * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = item / panels, p = item % panels;
      if (offsets[e + 1] > offsets[e]) expert_panel<BF16>(xs, offsets[e], offsets[e + 1], K, w + e * expert_bytes, y, N, p);
    }
  });
}

}  // namespace

torch::Tensor moe_experts(torch::Tensor x, torch::Tensor token, torch::Tensor weight, torch::Tensor offsets,
                          torch::Tensor w13, torch::Tensor w2) {
  const bool bf16 = w13.scalar_type() == at::kBFloat16;
  TORCH_CHECK(w2.scalar_type() == w13.scalar_type() && (bf16 || w13.scalar_type() == at::kFloat),
              "w13 and w2 must both be float32 or both bfloat16 panels");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "w13 and w2 must be contiguous");
  TORCH_CHECK(w13.dim() == (bf16 ? 5 : 4) && w2.dim() == w13.dim() && w13.size(0) == w2.size(0),
              "w13 / w2 must be [E, N/16, K, 16] (fp32) or [E, N/16, K/2, 16, 2] (bf16) panels of one E");
  const int64_t E = w13.size(0), T = x.size(0), n = token.size(0);
  const int64_t H = bf16 ? w13.size(2) * 2 : w13.size(2), I2 = w13.size(1) * kDensePanel, I = I2 / 2;
  TORCH_CHECK(w2.size(1) * kDensePanel == H && (bf16 ? w2.size(2) * 2 : w2.size(2)) == I,
              "w2's panels do not match w13's: [E, H/16, I, 16]");
  TORCH_CHECK(token.scalar_type() == at::kLong && token.is_contiguous() && token.dim() == 1, "token: int64 [n]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == n, "weight: fp32 [n]");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() && offsets.numel() == E + 1,
              "offsets: int64 [E + 1]");
  const int64_t* tok = token.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == n, "offsets must run from 0 to the number of pairs");
  std::vector<float> xscratch;
  const float* xp = float_x(x, H, xscratch);

  // the pairs' rows of x, in the pairs' order
  std::vector<float> xs(n * H), h13(n * I2), act(n * I), y(n * H);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(tok[i] >= 0 && tok[i] < T, "token ", tok[i], " is outside x's ", T, " rows");
    std::memcpy(xs.data() + i * H, xp + tok[i] * H, H * sizeof(float));
  }
  const auto* w13p = static_cast<const char*>(w13.data_ptr());
  const auto* w2p = static_cast<const char*>(w2.data_ptr());
  const int64_t esize = w13.element_size();
  if (bf16) experts_pass<true>(xs.data(), off, E, H, I2, w13p, I2 * H * esize, h13.data());
  else experts_pass<false>(xs.data(), off, E, H, I2, w13p, I2 * H * esize, h13.data());
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = h13.data() + r * I2;
      const float* u = g + I;
      float* o = act.data() + r * I;
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  if (bf16) experts_pass<true>(act.data(), off, E, I, H, w2p, H * I * esize, y.data());
  else experts_pass<false>(act.data(), off, E, I, H, w2p, H * I * esize, y.data());

  Out out(x, T, H);
  std::fill(out.data, out.data + T * H, 0.f);
  const float* wt = weight.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    float* o = out.data + tok[i] * H;
    const float* yi = y.data() + i * H;
    const float s = wt[i];
    for (int64_t j = 0; j < H; ++j) o[j] += s * yi[j];
  }
  return out.finish();
}
