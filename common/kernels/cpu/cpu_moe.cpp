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
  dense_panel_rows<BF16>(xs, m0, m1, K, w, y, N, p);
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

// The pairs' rows of x [T, H] (fp32), in the pairs' order: [n, H].
std::vector<float> gather_rows(const float* x, int64_t T, int64_t H, const int64_t* tok, int64_t n) {
  std::vector<float> xs(n * H);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(tok[i] >= 0 && tok[i] < T, "token ", tok[i], " is outside x's ", T, " rows");
    std::memcpy(xs.data() + i * H, x + tok[i] * H, H * sizeof(float));
  }
  return xs;
}

// act [n, I] = silu(gate) * up of h13 [n, 2I] (gate columns first).
void silu_mul_rows(const float* h13, int64_t n, int64_t I, float* act) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = h13 + r * 2 * I;
      const float* u = g + I;
      float* o = act + r * I;
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

// out [T, H] in x's dtype: per token, the sum of weight * y over its pairs, added in the pairs' order (ascending
// expert per token, as transformers' loop adds them), on one thread.
torch::Tensor weighted_sum(const torch::Tensor& x, int64_t T, int64_t H, const int64_t* tok, const float* wt,
                           int64_t n, const float* y) {
  Out out(x, T, H);
  std::fill(out.data, out.data + T * H, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    float* o = out.data + tok[i] * H;
    const float* yi = y + i * H;
    for (int64_t j = 0; j < H; ++j) o[j] += wt[i] * yi[j];
  }
  return out.finish();
}

// token / weight / offsets of n pairs over E experts: what both entry points take.
void check_pairs(const torch::Tensor& token, const torch::Tensor& weight, const torch::Tensor& offsets, int64_t E) {
  const int64_t n = token.size(0);
  TORCH_CHECK(token.scalar_type() == at::kLong && token.is_contiguous() && token.dim() == 1, "token: int64 [n]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == n, "weight: fp32 [n]");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() && offsets.numel() == E + 1,
              "offsets: int64 [E + 1]");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == n, "offsets must run from 0 to the number of pairs");
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
  check_pairs(token, weight, offsets, E);
  const int64_t* tok = token.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  std::vector<float> xscratch;
  const std::vector<float> xs = gather_rows(float_x(x, H, xscratch), T, H, tok, n);
  std::vector<float> h13(n * I2), act(n * I), y(n * H);
  const auto* w13p = static_cast<const char*>(w13.data_ptr());
  const auto* w2p = static_cast<const char*>(w2.data_ptr());
  const int64_t esize = w13.element_size();
  if (bf16) experts_pass<true>(xs.data(), off, E, H, I2, w13p, I2 * H * esize, h13.data());
  else experts_pass<false>(xs.data(), off, E, H, I2, w13p, I2 * H * esize, h13.data());
  silu_mul_rows(h13.data(), n, I, act.data());
  if (bf16) experts_pass<true>(act.data(), off, E, I, H, w2p, H * I * esize, y.data());
  else experts_pass<false>(act.data(), off, E, I, H, w2p, H * I * esize, y.data());
  return weighted_sum(x, T, H, tok, weight.data_ptr<float>(), n, y.data());
}

// ``moe_experts_packed``: the same with int8 or int4 experts in cpu_quant_panel.cpp's panel layouts, activations
// rounded to int8 in blocks of 32 (the ``tandem_a8`` path of a packed ``Linear``):
//
//   q13, s13, z13  each expert's gate/up panels stacked: int8 q [E, 2I/16, H/4, 16, 4] with fp32 scales [E, 2I]
//                  (one per row) or [E, 2I/16, H/G, 16]; int4 q [E, 2I/16, H/8, 16, 4] with fp16 scales and
//                  zeros [E, 2I/16, H/G, 16] (z13 empty for int8)
//   q2, s2, z2     the down panels the same way over [H, I]
//   g13, g2        each projection's group size (int8 per row: its input width)

namespace {

// Rows [m0, m1) x panel p of one expert's packed panels, on the calling thread: the tiles panel_matmul runs.
template <bool INT4>
void packed_rows(const PanelArgs& a, int64_t m0, int64_t m1, int64_t p) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (cpu_has_vnni()) {
    for (int64_t m = m0; m < m1; m += 4) Dispatch<4, 1, INT4, VnniTile>::run(a, m, p, std::min<int64_t>(4, m1 - m), 1);
    return;
  }
#endif
#if defined(__AVX2__)
  for (int64_t m = m0; m < m1; m += 2) Dispatch<2, 1, INT4, Avx2Tile>::run(a, m, p, std::min<int64_t>(2, m1 - m), 1);
#else
  for (int64_t m = m0; m < m1; ++m) panel_tile_generic<INT4>(a, m, p);
#endif
}

struct PackedExperts {
  const torch::Tensor &q, &s, &z;
  int64_t G;
  bool int4;
};

// One projection over every hit expert: y [n, N] = its rows of x [n, K] times its packed panels.
void packed_pass(const float* x, int64_t n, int64_t K, int64_t N, const int64_t* offsets, int64_t E,
                 const PackedExperts& w, float* y) {
  QuantX xq;
  quantize_x(x, n, K, w.G, xq);
  const int64_t panels = N / PANEL, groups = K / w.G;
  const bool per_row = !w.int4 && w.G == K;
  const int64_t q_bytes = w.int4 ? N * K / 2 : N * K;  // one expert's packed bytes
  const int64_t s_count = per_row ? N : N * groups;  // one expert's scales (and zeros)
  const auto* qp = static_cast<const uint8_t*>(w.q.data_ptr());
  at::parallel_for(0, E * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = item / panels, p = item % panels;
      if (offsets[e + 1] == offsets[e]) continue;
      const PanelArgs a = w.int4
          ? PanelArgs{xq, K, w.G, N, qp + e * q_bytes, nullptr,
                      reinterpret_cast<const uint16_t*>(w.s.data_ptr<at::Half>()) + e * s_count,
                      reinterpret_cast<const uint16_t*>(w.z.data_ptr<at::Half>()) + e * s_count, false, y}
          : PanelArgs{xq, K, w.G, N, qp + e * q_bytes, w.s.data_ptr<float>() + e * s_count, nullptr, nullptr,
                      per_row, y};
      if (w.int4) packed_rows<true>(a, offsets[e], offsets[e + 1], p);
      else packed_rows<false>(a, offsets[e], offsets[e + 1], p);
    }
  });
}

void check_packed(const torch::Tensor& q, const torch::Tensor& s, const torch::Tensor& z, bool int4, int64_t E,
                  int64_t N, int64_t K, int64_t G, const char* name) {
  TORCH_CHECK(q.is_contiguous() && q.dim() == 5 && q.size(0) == E && q.size(1) * PANEL == N && q.size(3) == PANEL &&
                  q.size(4) == 4 && q.size(2) * (int4 ? 8 : 4) == K,
              name, ": q must be contiguous [E, N/16, K/", int4 ? 8 : 4, ", 16, 4]");
  TORCH_CHECK(G % SUB == 0 && K % G == 0, name, ": the group size must be a multiple of 32 dividing K");
  if (int4) {
    TORCH_CHECK(q.scalar_type() == at::kByte && s.scalar_type() == at::kHalf && z.scalar_type() == at::kHalf &&
                    s.is_contiguous() && z.is_contiguous() && s.numel() == E * N * (K / G) && z.numel() == s.numel(),
                name, ": int4 needs uint8 q and contiguous fp16 scales, zeros [E, N/16, K/G, 16]");
  } else {
    TORCH_CHECK(q.scalar_type() == at::kChar && s.scalar_type() == at::kFloat && s.is_contiguous() &&
                    s.numel() == E * N * (K / G),
                name, ": int8 needs int8 q and contiguous fp32 scales [E, N] or [E, N/16, K/G, 16]");
  }
}

}  // namespace

torch::Tensor moe_experts_packed(torch::Tensor x, torch::Tensor token, torch::Tensor weight, torch::Tensor offsets,
                                 torch::Tensor q13, torch::Tensor s13, torch::Tensor z13, int64_t g13,
                                 torch::Tensor q2, torch::Tensor s2, torch::Tensor z2, int64_t g2) {
  const bool int4 = q13.scalar_type() == at::kByte;
  const int64_t E = q13.size(0), T = x.size(0), n = token.size(0);
  const int64_t I2 = q13.size(1) * PANEL, I = I2 / 2, H = q13.size(2) * (int4 ? 8 : 4);
  check_packed(q13, s13, z13, int4, E, I2, H, g13, "q13");
  check_packed(q2, s2, z2, int4, E, H, I, g2, "q2");
  check_pairs(token, weight, offsets, E);
  const int64_t* tok = token.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  std::vector<float> xscratch;
  const std::vector<float> xs = gather_rows(float_x(x, H, xscratch), T, H, tok, n);
  std::vector<float> h13(n * I2), act(n * I), y(n * H);
  packed_pass(xs.data(), n, H, I2, off, E, PackedExperts{q13, s13, z13, g13, int4}, h13.data());
  silu_mul_rows(h13.data(), n, I, act.data());
  packed_pass(act.data(), n, I, H, off, E, PackedExperts{q2, s2, z2, g2, int4}, y.data());
  return weighted_sum(x, T, H, tok, weight.data_ptr<float>(), n, y.data());
}
