// ``int8_matmul_panel`` / ``int4_matmul_panel``: int8 or int4 weights in 16-row panels times int8-rounded
// activations, at every batch size.
//
// The row-major layouts (cpu_quant.cpp) reduce along K, so every 32-weight block ends in a horizontal sum:
// fine for a GEMV, but at 64 rows the dequantize-and-GEMM path they need is slower than the bf16 GEMM of
// the unquantized weights. Here the weights are interleaved for the integer dot-product instructions, as
// oneDNN and llama.cpp's repacked kernels store them (common/quant/panels.py has the layouts):
//
//   int8 q [N/16, K/4, 16, 4]: panel, step of 4 weights, output row (16), the row's 4 weights
//   int4 q [N/16, K/8, 16, 4]: panel, step of 8 weights, output row, 4 bytes (weights j | j + 4 << 4)
//
// so one 64-byte load holds 4 (int8) or 8 (int4) weights of 16 output rows, and ``vpdpbusd``
// (AVX512-VNNI) multiplies 4 of them by 4 broadcast activation bytes into 16 int32 sums: 64 multiply-adds
// an instruction and no horizontal sums (bf16 ``vdpbf16ps`` does 32). The activations are rounded to int8
// in blocks of 32 with one fp32 scale each (QuantX, as the other ``*_a8`` kernels), so each block
// accumulates in int32 exactly and is scaled into fp32 once. ``vpdpbusd`` multiplies unsigned by signed
// bytes: int4 codes are unsigned already (the zero term is added per group from d * sum(xq), as in
// cpu_quant_a8.cpp); int8 weights are read as ``q + 128`` (one xor of the sign bit) and each block's sum
// starts at ``-128 * sum(xq)``, so it ends exactly ``dot(q, xq)``. Without VNNI (AVX2 builds, AVX-512 CPUs
// without it) the same layout runs ``vpmaddubsw`` + ``vpmaddwd`` (int8: |q| times x carrying q's sign),
// 8 rows a ymm; a plain loop otherwise.
//
// Scales: int8 one per output row, fp32 [N] (applied once at the end), or per group, fp32 [N/16, K/G, 16];
// int4 scales and zeros fp16 [N/16, K/G, 16]. A row's result depends only on its own x (the same operations
// in the same order whatever the batch), so speculative verification rows equal plain decode rows.
// ``formats.reference_a8_matmul`` is the math.

namespace {

constexpr int64_t PANEL = 16;  // output rows per panel
// A decode row (one activation row) streams each panel once: prefetch this many bytes ahead in it.
constexpr int64_t kPanelPrefetch = 1024;

struct PanelArgs {
  const QuantX& xq;
  int64_t K, G, N;
  const uint8_t* q;  // int8 [N/16, K/4, 16, 4] or int4 [N/16, K/8, 16, 4]
  const float* s;    // int8: [N] or [N/16, K/G, 16]
  const uint16_t* s16;  // int4: fp16 scales [N/16, K/G, 16]
  const uint16_t* z16;  // int4: fp16 zeros [N/16, K/G, 16]
  bool per_row;  // int8 with one scale per row
  float* y;  // [M, N] fp32
  int64_t panel_bytes() const { return s16 ? PANEL * K / 2 : PANEL * K; }
  int64_t group_at(int64_t p, int64_t g) const { return (p * (K / G) + g) * PANEL; }  // [N/16, K/G, 16] index
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i bcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof(four));
  return _mm512_set1_epi32(four);
}
// MR activation rows x NV panels (16 output rows each): MR * NV int32 and as many fp32 accumulators.
template <int MR, int NV, bool INT4>
void panel_tile_vnni(const PanelArgs& a, int64_t m0, int64_t p0) {
  const int64_t K = a.K, blocks = K / SUB, per_group = a.G / SUB, stride = a.panel_bytes();
  const uint8_t* w0 = a.q + p0 * stride;
  const int8_t* x0 = a.xq.q.data() + m0 * K;
  __m512 facc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) facc[m][v] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i iacc[MR][NV];
    for (int m = 0; m < MR; ++m) {
      const __m512i start = INT4 ? _mm512_setzero_si512() : _mm512_set1_epi32(-128 * a.xq.bsum[(m0 + m) * blocks + b]);
      for (int v = 0; v < NV; ++v) iacc[m][v] = start;
    }
    if constexpr (INT4) {
      for (int kk = 0; kk < SUB / 8; ++kk) {
        const int64_t k8 = b * (SUB / 8) + kk;
        __m512i lo[NV], hi[NV];
        for (int v = 0; v < NV; ++v) {
          if (MR == 1) prefetch(w0 + v * stride + k8 * 64 + kPanelPrefetch);
          const __m512i raw = _mm512_loadu_si512(w0 + v * stride + k8 * 64);
          lo[v] = _mm512_and_si512(raw, low);
          hi[v] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        for (int m = 0; m < MR; ++m) {
          const __m512i xl = bcast4(x0 + m * K + k8 * 8), xh = bcast4(x0 + m * K + k8 * 8 + 4);
          for (int v = 0; v < NV; ++v)
            iacc[m][v] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(iacc[m][v], lo[v], xl), hi[v], xh);
        }
      }
    } else {
      for (int kk = 0; kk < SUB / 4; ++kk) {
        const int64_t k4 = b * (SUB / 4) + kk;
        __m512i w[NV];
        for (int v = 0; v < NV; ++v) {
          if (MR == 1) prefetch(w0 + v * stride + k4 * 64 + kPanelPrefetch);
          w[v] = _mm512_xor_si512(_mm512_loadu_si512(w0 + v * stride + k4 * 64), flip);
        }
        for (int m = 0; m < MR; ++m) {
          const __m512i xb = bcast4(x0 + m * K + k4 * 4);
          for (int v = 0; v < NV; ++v) iacc[m][v] = _mm512_dpbusd_epi32(iacc[m][v], w[v], xb);
        }
      }
    }
    if (a.per_row) {
      for (int m = 0; m < MR; ++m) {
        const __m512 d = _mm512_set1_ps(a.xq.d[(m0 + m) * blocks + b]);
        for (int v = 0; v < NV; ++v) facc[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][v]), d, facc[m][v]);
      }
      continue;
    }
    const int64_t g = b / per_group;
    __m512 ws[NV];
    for (int v = 0; v < NV; ++v)
      ws[v] = INT4 ? half16(a.s16 + a.group_at(p0 + v, g)) : _mm512_loadu_ps(a.s + a.group_at(p0 + v, g));
    for (int m = 0; m < MR; ++m) {
      const __m512 d = _mm512_set1_ps(a.xq.d[(m0 + m) * blocks + b]);
      for (int v = 0; v < NV; ++v)
        facc[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][v]), _mm512_mul_ps(ws[v], d), facc[m][v]);
    }
    if (INT4 && (b + 1) % per_group == 0) {  // the group's zero times d * sum(xq) over the group
      const int64_t groups = K / a.G;
      for (int v = 0; v < NV; ++v) {
        const __m512 zs = half16(a.z16 + a.group_at(p0 + v, g));
        for (int m = 0; m < MR; ++m)
          facc[m][v] = _mm512_fmadd_ps(zs, _mm512_set1_ps(a.xq.gsum[(m0 + m) * groups + g]), facc[m][v]);
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
inline __m256i bcast4_256(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof(four));
  return _mm256_set1_epi32(four);
}
inline __m256 half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// The same tile without VNNI, 8 output rows per ymm (a panel is two vectors): int8 multiplies |q| by x
// carrying q's sign (pairs at most 2 * 127 * 127, no int16 saturation), int4 its codes by x (2 * 15 * 127).
template <int MR, int NV, bool INT4>
void panel_tile_avx2(const PanelArgs& a, int64_t m0, int64_t p0) {
  constexpr int NH = 2 * NV;  // ymm vectors of 8 rows
  const int64_t K = a.K, blocks = K / SUB, per_group = a.G / SUB, stride = a.panel_bytes();
  const uint8_t* w0 = a.q + p0 * stride;
  const int8_t* x0 = a.xq.q.data() + m0 * K;
  __m256 facc[MR][NH];
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < NH; ++h) facc[m][h] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  const auto at = [&](int h, int64_t step) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + (h / 2) * stride + step * 64 + (h % 2) * 32));
  };
  const auto dot = [&](__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones); };
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i iacc[MR][NH];
    for (int m = 0; m < MR; ++m)
      for (int h = 0; h < NH; ++h) iacc[m][h] = _mm256_setzero_si256();
    if constexpr (INT4) {
      for (int64_t k8 = b * (SUB / 8); k8 < (b + 1) * (SUB / 8); ++k8) {
        __m256i lo[NH], hi[NH];
        for (int h = 0; h < NH; ++h) {
          const __m256i raw = at(h, k8);
          lo[h] = _mm256_and_si256(raw, low);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
        for (int m = 0; m < MR; ++m) {
          const __m256i xl = bcast4_256(x0 + m * K + k8 * 8), xh = bcast4_256(x0 + m * K + k8 * 8 + 4);
          for (int h = 0; h < NH; ++h)
            iacc[m][h] = _mm256_add_epi32(iacc[m][h], _mm256_add_epi32(dot(lo[h], xl), dot(hi[h], xh)));
        }
      }
    } else {
      for (int64_t k4 = b * (SUB / 4); k4 < (b + 1) * (SUB / 4); ++k4) {
        __m256i w[NH], u[NH];
        for (int h = 0; h < NH; ++h) {
          w[h] = at(h, k4);
          u[h] = _mm256_sign_epi8(w[h], w[h]);
        }
        for (int m = 0; m < MR; ++m) {
          const __m256i xb = bcast4_256(x0 + m * K + k4 * 4);
          for (int h = 0; h < NH; ++h) iacc[m][h] = _mm256_add_epi32(iacc[m][h], dot(u[h], _mm256_sign_epi8(xb, w[h])));
        }
      }
    }
    const int64_t g = b / per_group, groups = K / a.G;
    for (int h = 0; h < NH; ++h) {
      const int64_t gi = a.group_at(p0 + h / 2, g) + (h % 2) * 8;
      const __m256 ws = a.per_row ? _mm256_set1_ps(1.f) : INT4 ? half8(a.s16 + gi) : _mm256_loadu_ps(a.s + gi);
      for (int m = 0; m < MR; ++m) {
        const __m256 d = _mm256_set1_ps(a.xq.d[(m0 + m) * blocks + b]);
        facc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m][h]), _mm256_mul_ps(ws, d), facc[m][h]);
      }
      if (INT4 && (b + 1) % per_group == 0) {
        const __m256 zs = half8(a.z16 + gi);
        for (int m = 0; m < MR; ++m)
          facc[m][h] = _mm256_fmadd_ps(zs, _mm256_set1_ps(a.xq.gsum[(m0 + m) * groups + g]), facc[m][h]);
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
template <bool INT4>
void panel_tile_generic(const PanelArgs& a, int64_t m, int64_t p) {
  const int64_t K = a.K, blocks = K / SUB, groups = K / a.G, per_group = a.G / SUB;
  const uint8_t* w0 = a.q + p * a.panel_bytes();
  const int8_t* x = a.xq.q.data() + m * K;
  float acc[PANEL] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t dot[PANEL] = {};
    for (int64_t k = b * SUB; k < (b + 1) * SUB; ++k)
      for (int n = 0; n < PANEL; ++n) {
        int32_t w;
        if constexpr (INT4) {
          const uint8_t byte = w0[(k / 8) * 64 + n * 4 + (k % 4)];
          w = (k % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
        } else {
          w = static_cast<int8_t>(w0[(k / 4) * 64 + n * 4 + k % 4]);
        }
        dot[n] += w * x[k];
      }
    const float d = a.xq.d[m * blocks + b];
    const int64_t g = b / per_group;
    for (int n = 0; n < PANEL; ++n) {
      const int64_t gi = a.group_at(p, g) + n;
      const float ws = a.per_row ? 1.f : INT4 ? half_to_float(a.s16[gi]) : a.s[gi];
      acc[n] += static_cast<float>(dot[n]) * (ws * d);
      if (INT4 && (b + 1) % per_group == 0) acc[n] += half_to_float(a.z16[gi]) * a.xq.gsum[m * groups + g];
    }
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
template <int MR, int NV, bool INT4, template <int, int, bool> class T>
struct Dispatch {
  static void run(const PanelArgs& a, int64_t m0, int64_t p0, int64_t mr, int64_t nv) {
    if (mr == MR && nv == NV) return T<MR, NV, INT4>::run(a, m0, p0);
    if (nv < NV) return Dispatch<MR, (NV > 1 ? NV - 1 : 1), INT4, T>::run(a, m0, p0, mr, nv);
    if constexpr (MR > 1) return Dispatch<MR - 1, NV, INT4, T>::run(a, m0, p0, mr, nv);
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <int MR, int NV, bool INT4>
struct VnniTile {
  static void run(const PanelArgs& a, int64_t m0, int64_t p0) { panel_tile_vnni<MR, NV, INT4>(a, m0, p0); }
};
#endif
#if defined(__AVX2__)
template <int MR, int NV, bool INT4>
struct Avx2Tile {
  static void run(const PanelArgs& a, int64_t m0, int64_t p0) { panel_tile_avx2<MR, NV, INT4>(a, m0, p0); }
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

template <bool INT4>
void panel_matmul(const PanelArgs& args, int64_t M) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (cpu_has_vnni()) {
    panel_rows<4, 3>(args, M, [&](int64_t m, int64_t p, int64_t mr, int64_t nv) {
      Dispatch<4, 3, INT4, VnniTile>::run(args, m, p, mr, nv);
    });
    return;
  }
#endif
#if defined(__AVX2__)
  panel_rows<2, 1>(args, M, [&](int64_t m, int64_t p, int64_t mr, int64_t nv) {
    Dispatch<2, 1, INT4, Avx2Tile>::run(args, m, p, mr, nv);
  });
#else
  panel_rows<1, 1>(args, M, [&](int64_t m, int64_t p, int64_t, int64_t) { panel_tile_generic<INT4>(args, m, p); });
#endif
}

void check_panels(const torch::Tensor& q, int64_t per_step, int64_t G, int64_t K) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == PANEL && q.size(3) == 4 && q.is_contiguous(),
              "q must be contiguous [N/16, K/", per_step, ", 16, 4]");
  TORCH_CHECK(G % SUB == 0 && K % G == 0, "group_size must be a multiple of 32 dividing K");
}

}  // namespace

// Which inner loop the panel kernels run on this CPU: vnni | maddubs | generic.
std::string int8_panel_path() { return panel_path(); }

torch::Tensor int8_matmul_panel(torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t group_size) {
  check_panels(q, 4, group_size, q.size(1) * 4);
  TORCH_CHECK(q.scalar_type() == at::kChar, "q must be int8 [N/16, K/4, 16, 4]");
  const int64_t N = q.size(0) * PANEL, K = q.size(1) * 4, M = x.size(0), G = group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / G),
              "scales must be contiguous fp32 [N] (one per row) or [N/16, K/group_size, 16]");
  std::vector<float> xs;
  QuantX xq;
  quantize_x(float_x(x, K, xs), M, K, G, xq);
  Out out(x, M, N);
  const PanelArgs args{xq, K, G, N, reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>()), scales.data_ptr<float>(),
                       nullptr, nullptr, G == K, out.data};
  panel_matmul<false>(args, M);
  return out.finish();
}

torch::Tensor int4_matmul_panel(torch::Tensor x, torch::Tensor q, torch::Tensor scales, torch::Tensor zeros,
                                int64_t group_size) {
  check_panels(q, 8, group_size, q.size(1) * 8);
  TORCH_CHECK(q.scalar_type() == at::kByte, "q must be uint8 [N/16, K/8, 16, 4]");
  const int64_t N = q.size(0) * PANEL, K = q.size(1) * 8, M = x.size(0), G = group_size;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && zeros.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  zeros.is_contiguous() && scales.numel() == N * (K / G) && zeros.numel() == scales.numel(),
              "scales, zeros must be contiguous fp16 [N/16, K/group_size, 16]");
  std::vector<float> xs;
  QuantX xq;
  quantize_x(float_x(x, K, xs), M, K, G, xq);
  Out out(x, M, N);
  const PanelArgs args{xq, K, G, N, q.data_ptr<uint8_t>(), nullptr,
                       reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                       reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::Half>()), false, out.data};
  panel_matmul<true>(args, M);
  return out.finish();
}

// Rows [row0, row1) of panel weights back to row-major [rows, K] fp32 or bf16 (w = q * s; int4 w = code * s + z,
// one rounding): the dequantize-and-GEMM path of large batches (prefill) without the CPU's vector
// instructions for integers. Each 32-weight block of a row is gathered from its panel into the row-major
// packing the row-major kernels unpack (cpu_quant.cpp), then unpacked, scaled and stored as they do.
torch::Tensor int8_dequantize_panel(torch::Tensor q, torch::Tensor scales, int64_t group_size, int64_t row0,
                                    int64_t row1, at::ScalarType dtype) {
  check_panels(q, 4, group_size, q.size(1) * 4);
  const int64_t N = q.size(0) * PANEL, K = q.size(1) * 4, groups = K / group_size;
  TORCH_CHECK(0 <= row0 && row0 <= row1 && row1 <= N, "row range out of bounds");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * groups,
              "scales must be contiguous fp32 [N] or [N/16, K/group_size, 16]");
  const auto* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const bool per_row = group_size == K;
  return dequantize_into(q, row0, row1, K, dtype, [&](int64_t n, int64_t k, auto* out) {
    const int64_t p = n / PANEL, r = n % PANEL, g = k / group_size;
    alignas(32) int8_t block[SUB];
    const int8_t* src = qp + (p * (K / 4) + k / 4) * 64 + r * 4;  // step k/4 of the panel, row r's 4 bytes
    for (int64_t s = 0; s < SUB / 4; ++s) std::memcpy(block + 4 * s, src + 64 * s, 4);
    const vf sc = vset1(per_row ? sp[n] : sp[(p * groups + g) * PANEL + r]);
    vf w[NV];
    unpack_q8(block, w);
    for (int v = 0; v < NV; ++v) vstore(out + v * VL, vmul(w[v], sc));
  });
}

torch::Tensor int4_dequantize_panel(torch::Tensor q, torch::Tensor scales, torch::Tensor zeros, int64_t group_size,
                                    int64_t row0, int64_t row1, at::ScalarType dtype) {
  check_panels(q, 8, group_size, q.size(1) * 8);
  const int64_t N = q.size(0) * PANEL, K = q.size(1) * 8, groups = K / group_size;
  TORCH_CHECK(0 <= row0 && row0 <= row1 && row1 <= N, "row range out of bounds");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && zeros.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  zeros.is_contiguous() && scales.numel() == N * groups && zeros.numel() == scales.numel(),
              "scales, zeros must be contiguous fp16 [N/16, K/group_size, 16]");
  const auto* qp = q.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* zp = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::Half>());
  return dequantize_into(q, row0, row1, K, dtype, [&](int64_t n, int64_t k, auto* out) {
    const int64_t p = n / PANEL, r = n % PANEL, gi = (p * groups + k / group_size) * PANEL + r;
    // steps k/8 .. k/8 + 3 of the panel: row r's byte j holds weight 8s + j (low nibble) and 8s + j + 4 (high);
    // the row-major packing holds weight j in byte j's low nibble and j + 16 in its high one (j < 16).
    uint8_t codes[SUB];
    const uint8_t* src = qp + (p * (K / 8) + k / 8) * 64 + r * 4;
    for (int64_t s = 0; s < SUB / 8; ++s)
      for (int j = 0; j < 4; ++j) {
        const uint8_t b = src[64 * s + j];
        codes[8 * s + j] = b & 0x0F;
        codes[8 * s + j + 4] = b >> 4;
      }
    alignas(16) uint8_t packed[SUB / 2];
    for (int j = 0; j < SUB / 2; ++j) packed[j] = static_cast<uint8_t>(codes[j] | (codes[j + SUB / 2] << 4));
    const vf sc = vset1(half_to_float(sp[gi])), zc = vset1(half_to_float(zp[gi]));
    vf w[NV];
    unpack_q4(packed, w);
    for (int v = 0; v < NV; ++v) vstore(out + v * VL, vfma(w[v], sc, zc));
  });
}
