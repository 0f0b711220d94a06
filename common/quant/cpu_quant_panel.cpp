// ``int8_matmul_panel``: int8 weights in 16-row panels times int8-rounded activations, at every batch size.
//
// The row-major int8 layout (cpu_quant.cpp) reduces along K, so every 32-weight block ends in a horizontal
// sum: fine for a GEMV, but at 64 rows the dequantize-and-GEMM path it needs is slower than the bf16 GEMM
// of the unquantized weights. Here the weights are stored as oneDNN and llama.cpp's repacked kernels store
// them, interleaved for the integer dot-product instructions:
//
//   qp int8 [N/16, K/4, 16, 4]: panel p, step k4, output row n (16 of them), 4 consecutive weights of K
//
// so one 64-byte load holds 4 weights of 16 output rows, and ``vpdpbusd`` (AVX512-VNNI) multiplies them by
// 4 broadcast activation bytes into 16 int32 sums: 64 multiply-adds per instruction, no horizontal sums
// (bf16 ``vdpbf16ps`` does 32). The activations are rounded to int8 in blocks of 32 with one fp32 scale
// each (QuantX, as the other ``*_a8`` kernels), so each block's 8 steps accumulate in int32 exactly and
// are scaled into fp32 once. ``vpdpbusd`` multiplies unsigned by signed bytes: the weights are read as
// ``q + 128`` (one xor of the sign bit) and each block's int32 sum starts at ``-128 * sum(xq)``, so it ends
// exactly ``dot(q, xq)``. Without VNNI (AVX2 builds, and AVX-512 CPUs without it) the same layout runs
// ``vpmaddubsw`` + ``vpmaddwd`` on |q| and sign-carrying x, 8 rows per ymm; a plain loop otherwise.
//
// Scales: one per output row, fp32 [N] (group_size == K; applied once at the end), or per group
// (GGUF Q8_0: group 32), fp32 [N/16, K/G, 16], applied per block. A row's result depends only on its own x
// (the same operations in the same order whatever the batch), so speculative verification rows equal
// plain decode rows. ``formats.reference_a8_matmul`` is the math, ``formats.pack_int8_panels`` the layout.

namespace {

constexpr int64_t PANEL = 16;  // output rows per panel

struct PanelArgs {
  const QuantX& xq;
  int64_t K, G, N;
  const int8_t* q;  // [N/16, K/4, 16, 4]
  const float* s;   // [N] or [N/16, K/G, 16]
  bool per_row;
  float* y;  // [M, N] fp32
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
// MR activation rows x NV panels (16 output rows each): MR * NV int32 and as many fp32 accumulators.
template <int MR, int NV>
void panel_tile_vnni(const PanelArgs& a, int64_t m0, int64_t p0) {
  const int64_t K = a.K, blocks = K / SUB, groups = K / a.G, per_group = a.G / SUB;
  const int8_t* w0 = a.q + p0 * PANEL * K;
  __m512 facc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) facc[m][v] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i iacc[MR][NV];
    for (int m = 0; m < MR; ++m) {
      const __m512i start = _mm512_set1_epi32(-128 * a.xq.bsum[(m0 + m) * blocks + b]);
      for (int v = 0; v < NV; ++v) iacc[m][v] = start;
    }
    for (int kk = 0; kk < SUB / 4; ++kk) {
      const int64_t k4 = b * (SUB / 4) + kk;
      __m512i w[NV];
      for (int v = 0; v < NV; ++v)
        w[v] = _mm512_xor_si512(_mm512_loadu_si512(w0 + v * PANEL * K + k4 * 64), flip);
      for (int m = 0; m < MR; ++m) {
        int32_t four;
        std::memcpy(&four, a.xq.q.data() + (m0 + m) * K + k4 * 4, sizeof(four));
        const __m512i xb = _mm512_set1_epi32(four);
        for (int v = 0; v < NV; ++v) iacc[m][v] = _mm512_dpbusd_epi32(iacc[m][v], w[v], xb);
      }
    }
    if (a.per_row) {
      for (int m = 0; m < MR; ++m) {
        const __m512 d = _mm512_set1_ps(a.xq.d[(m0 + m) * blocks + b]);
        for (int v = 0; v < NV; ++v) facc[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][v]), d, facc[m][v]);
      }
    } else {
      const int64_t g = b / per_group;
      __m512 ws[NV];
      for (int v = 0; v < NV; ++v) ws[v] = _mm512_loadu_ps(a.s + ((p0 + v) * groups + g) * PANEL);
      for (int m = 0; m < MR; ++m) {
        const __m512 d = _mm512_set1_ps(a.xq.d[(m0 + m) * blocks + b]);
        for (int v = 0; v < NV; ++v)
          facc[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][v]), _mm512_mul_ps(ws[v], d), facc[m][v]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) {
      __m512 r = facc[m][v];
      if (a.per_row) r = _mm512_mul_ps(r, _mm512_loadu_ps(a.s + (p0 + v) * PANEL));
      _mm512_storeu_ps(a.y + (m0 + m) * a.N + (p0 + v) * PANEL, r);
    }
}
#pragma GCC pop_options

bool cpu_has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has;
}
#endif

#if defined(__AVX2__)
// The same tile without VNNI: |q| (unsigned) times x carrying q's sign, pairs summed in int16 (at most
// 2 * 127 * 127, no saturation) and then in int32. 8 output rows per ymm, so a panel is two vectors.
template <int MR, int NV>
void panel_tile_avx2(const PanelArgs& a, int64_t m0, int64_t p0) {
  constexpr int NH = 2 * NV;  // ymm vectors of 8 rows
  const int64_t K = a.K, blocks = K / SUB, groups = K / a.G, per_group = a.G / SUB;
  const int8_t* w0 = a.q + p0 * PANEL * K;
  __m256 facc[MR][NH];
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < NH; ++h) facc[m][h] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i iacc[MR][NH];
    for (int m = 0; m < MR; ++m)
      for (int h = 0; h < NH; ++h) iacc[m][h] = _mm256_setzero_si256();
    for (int kk = 0; kk < SUB / 4; ++kk) {
      const int64_t k4 = b * (SUB / 4) + kk;
      __m256i w[NH], u[NH];
      for (int h = 0; h < NH; ++h) {
        w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + (h / 2) * PANEL * K + k4 * 64 + (h % 2) * 32));
        u[h] = _mm256_sign_epi8(w[h], w[h]);
      }
      for (int m = 0; m < MR; ++m) {
        int32_t four;
        std::memcpy(&four, a.xq.q.data() + (m0 + m) * K + k4 * 4, sizeof(four));
        const __m256i xb = _mm256_set1_epi32(four);
        for (int h = 0; h < NH; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(u[h], _mm256_sign_epi8(xb, w[h]));
          iacc[m][h] = _mm256_add_epi32(iacc[m][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    const int64_t g = b / per_group;
    for (int m = 0; m < MR; ++m) {
      const __m256 d = _mm256_set1_ps(a.xq.d[(m0 + m) * blocks + b]);
      for (int h = 0; h < NH; ++h) {
        const __m256 scale = a.per_row ? d
            : _mm256_mul_ps(_mm256_loadu_ps(a.s + ((p0 + h / 2) * groups + g) * PANEL + (h % 2) * 8), d);
        facc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m][h]), scale, facc[m][h]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < NH; ++h) {
      const int64_t n = (p0 + h / 2) * PANEL + (h % 2) * 8;
      __m256 r = facc[m][h];
      if (a.per_row) r = _mm256_mul_ps(r, _mm256_loadu_ps(a.s + n));
      _mm256_storeu_ps(a.y + (m0 + m) * a.N + n, r);
    }
}
#endif

// The plain loop, any CPU: one panel, one activation row.
void panel_tile_generic(const PanelArgs& a, int64_t m, int64_t p) {
  const int64_t K = a.K, blocks = K / SUB, groups = K / a.G, per_group = a.G / SUB;
  const int8_t* w0 = a.q + p * PANEL * K;
  const int8_t* x = a.xq.q.data() + m * K;
  float acc[PANEL] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t dot[PANEL] = {};
    for (int64_t k4 = b * (SUB / 4); k4 < (b + 1) * (SUB / 4); ++k4)
      for (int n = 0; n < PANEL; ++n)
        for (int j = 0; j < 4; ++j) dot[n] += w0[k4 * 64 + n * 4 + j] * x[k4 * 4 + j];
    const float d = a.xq.d[m * blocks + b];
    for (int n = 0; n < PANEL; ++n)
      acc[n] += static_cast<float>(dot[n]) * (a.per_row ? d : a.s[(p * groups + b / per_group) * PANEL + n] * d);
  }
  for (int n = 0; n < PANEL; ++n) a.y[m * a.N + p * PANEL + n] = a.per_row ? acc[n] * a.s[p * PANEL + n] : acc[n];
}

// Tiles of MR rows x NV panels, each tile written by one thread; rows in chunks so a chunk's int8 x stays
// in L2 while every panel passes over it.
template <int MR, int NV, typename Tile>
void panel_rows(const PanelArgs& a, int64_t M, Tile tile) {
  const int64_t panels = a.N / PANEL, tiles = (panels + NV - 1) / NV;
  constexpr int64_t kChunk = 256;
  for (int64_t c0 = 0; c0 < M; c0 += kChunk) {
    const int64_t c1 = std::min(M, c0 + kChunk);
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t p0 = t * NV, nv = std::min<int64_t>(NV, panels - p0);
        for (int64_t m = c0; m < c1;) {
          const int64_t mr = std::min<int64_t>(MR, c1 - m);
          tile(m, p0, mr, nv);
          m += mr;
        }
      }
    });
  }
}

// Dispatch a runtime (mr, nv) <= (MR, NV) onto the template instances.
template <int MR, int NV, template <int, int> class K>
struct Dispatch {
  static void run(const PanelArgs& a, int64_t m0, int64_t p0, int64_t mr, int64_t nv) {
    if (mr == MR && nv == NV) return K<MR, NV>::run(a, m0, p0);
    if (nv < NV) return Dispatch<MR, (NV > 1 ? NV - 1 : 1), K>::run(a, m0, p0, mr, nv);
    if constexpr (MR > 1) return Dispatch<MR - 1, NV, K>::run(a, m0, p0, mr, nv);
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <int MR, int NV>
struct VnniTile {
  static void run(const PanelArgs& a, int64_t m0, int64_t p0) { panel_tile_vnni<MR, NV>(a, m0, p0); }
};
#endif
#if defined(__AVX2__)
template <int MR, int NV>
struct Avx2Tile {
  static void run(const PanelArgs& a, int64_t m0, int64_t p0) { panel_tile_avx2<MR, NV>(a, m0, p0); }
};
#endif

const char* panel_path() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (cpu_has_vnni()) return "vnni";
#endif
#if defined(__AVX2__)
  return "maddubs";
#else
  return "generic";
#endif
}

}  // namespace

// Which inner loop ``int8_matmul_panel`` runs on this CPU: vnni | maddubs | generic.
std::string int8_panel_path() { return panel_path(); }

torch::Tensor int8_matmul_panel(torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t group_size) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == PANEL && q.size(3) == 4 && q.scalar_type() == at::kChar &&
                  q.is_contiguous(), "q must be contiguous int8 [N/16, K/4, 16, 4]");
  const int64_t N = q.size(0) * PANEL, K = q.size(1) * 4, M = x.size(0), G = group_size;
  TORCH_CHECK(G % SUB == 0 && K % G == 0, "group_size must be a multiple of 32 dividing K");
  const bool per_row = G == K;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / G),
              "scales must be contiguous fp32 [N] (one per row) or [N/16, K/group_size, 16]");
  std::vector<float> xs;
  QuantX xq;
  quantize_x(float_x(x, K, xs), M, K, G, xq);
  Out out(x, M, N);
  const PanelArgs args{xq, K, G, N, q.data_ptr<int8_t>(), scales.data_ptr<float>(), per_row, out.data};
  const std::string path = panel_path();
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (path == "vnni") {
    panel_rows<4, 3>(args, M, [&](int64_t m, int64_t p, int64_t mr, int64_t nv) {
      Dispatch<4, 3, VnniTile>::run(args, m, p, mr, nv);
    });
    return out.finish();
  }
#endif
#if defined(__AVX2__)
  panel_rows<2, 1>(args, M, [&](int64_t m, int64_t p, int64_t mr, int64_t nv) {
    Dispatch<2, 1, Avx2Tile>::run(args, m, p, mr, nv);
  });
#else
  panel_rows<1, 1>(args, M, [&](int64_t m, int64_t p, int64_t, int64_t) { panel_tile_generic(args, m, p); });
#endif
  return out.finish();
}
