// AMX (Advanced Matrix Extensions, Intel Sapphire Rapids and later): ``tdpbf16ps`` on 16-row panels.
//
// The bf16 panel layout ``[N/16, K/2, 16, 2]`` (common/model/gemv.py's ``PanelLinear``) is, 16 pairs at a
// time, exactly AMX's B-tile layout: 16 rows of 64 bytes (16 output rows x a pair of weights), one
// contiguous KiB. So the panels feed the tile unit as they lie: no per-call reorder of the weights (what
// oneDNN does for a plain row-major matrix at every call) and the same single copy of the weights serves
// the ``vdpbf16ps`` loop at batch 1 and AMX from a few rows up. The tiles:
//
//   C0..C3  fp32 accumulators, [16 rows of x] x [16 outputs of a panel]: 2 row groups x 2 panels
//   A0, A1  16 rows of x, 32 bf16 of K each (64 bytes a row, stride K * 2)
//   B0, B1  16 pairs of K of two panels
//
// Each tile's fp32 sums pass through L1 and are rounded once into the output (bf16, round to nearest even,
// as the other kernels' ``Out``): no [M, N] fp32 buffer, which at prefill sizes cost more memory traffic
// than the weights. The rows past the last multiple of 16 are copied into one zero-padded group.
//
// Linux grants the tile state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM); ``amx_ready()``
// asks once and reports false where the CPU, the kernel or the compiler lacks AMX, and the callers keep
// the AVX-512 loops. Each thread of ``at::parallel_for`` loads the tile configuration itself and releases
// it at the end (tile state is per thread).

// TANDEM_HAVE_AMX, tandem_amx::ready() and TileConfig: amx_tiles.h, included before this file.

namespace {

constexpr int64_t kAmxPanel = 16;  // output rows per panel (common/quant/panels.py's PANEL_ROWS)

#ifdef TANDEM_HAVE_AMX

constexpr int64_t kAmxPrefetch = 4096;  // bytes ahead of a panel's tile that its first pass prefetches
constexpr int64_t kAmxChunkBytes = 256 << 10;  // weights a thread holds in L2 while every row group passes

bool amx_ready() { return tandem_amx::ready(); }

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

using tandem_amx::TileConfig;

// The output: bf16 [M, N] rounded from the tiles' fp32 sums (round to nearest even, as ``Out::finish``),
// or fp32 [M, N] as they are; rows from ``rows`` on (the padding of the last group) are dropped.
struct AmxOut {
  void* y;
  bool bf16;
  int64_t N, M;
  const float* col_scale = nullptr;  // per output column (int8 with one scale per row of the weights)
};

#pragma GCC push_options
#pragma GCC target("avx512bf16")
inline void amx_store(const float* c, const AmxOut& out, int64_t m, int64_t col) {
  const int64_t rows = std::min<int64_t>(16, out.M - m);
  if (out.col_scale != nullptr) {
    const __m512 s = _mm512_loadu_ps(out.col_scale + col);
    auto* y = static_cast<uint16_t*>(out.y) + m * out.N + col;
    for (int64_t r = 0; r < rows; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * out.N),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(c + r * 16), s))));
  } else if (out.bf16) {
    auto* y = static_cast<uint16_t*>(out.y) + m * out.N + col;
    for (int64_t r = 0; r < rows; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * out.N),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(c + r * 16))));
  } else {
    auto* y = static_cast<float*>(out.y) + m * out.N + col;
    for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(y + r * out.N, _mm512_load_ps(c + r * 16));
  }
}
#pragma GCC pop_options

// 32 rows (``ROWS2``; else 16) of padded x from row m, against panel p (and p + 1: ``TWO``). The sums go
// through ``c`` (4 tiles of 16 x 16 fp32, in L1) to the output.
template <bool ROWS2, bool TWO, bool PF>
inline void amx_tile(const uint16_t* xa, const uint16_t* xb, int64_t K, const uint16_t* b0, const AmxOut& out,
                     int64_t p, int64_t m, float* c) {
  const uint16_t* b1 = b0 + kAmxPanel * K;
  const int64_t xs = K * 2;
  _tile_zero(0);
  if constexpr (ROWS2) _tile_zero(1);
  if constexpr (TWO) _tile_zero(2);
  if constexpr (ROWS2 && TWO) _tile_zero(3);
  for (int64_t k = 0; k < K; k += 32) {
    if constexpr (PF) {  // the chunk's first pass reads DRAM: ask for the tiles kAmxPrefetch ahead
      const char* ahead = reinterpret_cast<const char*>(b0 + k * kAmxPanel) + kAmxPrefetch;
      for (int line = 0; line < 1024; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      if constexpr (TWO)
        for (int line = 0; line < 1024; line += 64) _mm_prefetch(ahead + kAmxPanel * K * 2 + line, _MM_HINT_T0);
    }
    _tile_loadd(4, xa + k, xs);
    if constexpr (ROWS2) _tile_loadd(5, xb + k, xs);
    _tile_loadd(6, b0 + k * kAmxPanel, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (ROWS2) _tile_dpbf16ps(1, 5, 6);
    if constexpr (TWO) {
      _tile_loadd(7, b1 + k * kAmxPanel, 64);
      _tile_dpbf16ps(2, 4, 7);
      if constexpr (ROWS2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t col = p * kAmxPanel;
  _tile_stored(0, c, 64);
  amx_store(c, out, m, col);
  if constexpr (ROWS2) {
    _tile_stored(1, c + 256, 64);
    amx_store(c + 256, out, m + 16, col);
  }
  if constexpr (TWO) {
    _tile_stored(2, c + 512, 64);
    amx_store(c + 512, out, m, col + kAmxPanel);
  }
  if constexpr (ROWS2 && TWO) {
    _tile_stored(3, c + 768, 64);
    amx_store(c + 768, out, m + 16, col + kAmxPanel);
  }
}

// Row group m (32 rows at xa, xb = xa + 16 rows; or 16 rows at xa) over panels [p0, p1) of the chunk whose
// bf16 panels start at ``w``.
template <bool ROWS2, bool PF>
inline void amx_rows(const uint16_t* xa, const uint16_t* xb, int64_t K, const uint16_t* w, int64_t p0, int64_t p1,
                     const AmxOut& out, int64_t m, float* c) {
  for (int64_t p = p0; p < p1; p += 2) {
    const uint16_t* b0 = w + (p - p0) * kAmxPanel * K;
    if (p + 1 < p1) amx_tile<ROWS2, true, PF>(xa, xb, K, b0, out, p, m, c);
    else amx_tile<ROWS2, false, PF>(xa, xb, K, b0, out, p, m, c);
  }
}

// out [M, N] = x [M, K] bf16 (K a multiple of 32) times ``panels`` bf16 panels [K/2, 16, 2] that
// ``source(p0, p1, scratch)`` gives (a pointer to panels p0 .. p1: the weights themselves, or a chunk
// dequantized into ``scratch``), for the panel pairs [t0, t1) on the calling thread (``amx_panels`` splits
// the pairs over its threads; common/kernels/cpu/cpu_step.cpp's one-call step over its own). Rows go in groups of
// 32, then 16; the rows past the last multiple of 16 come from ``tail``: 16 zero-padded rows
// (``amx_tail``). A thread takes its panel pairs in chunks of ``kAmxChunkBytes`` of bf16 weights: the
// first row group pulls a chunk into L2 (from DRAM, prefetching, or as the source writes it), the others
// read it there, and each row group's x stays in L1 while it passes over the chunk. A tile's sums do not
// depend on the split: every output is one tile's full sum over K.
template <bool PREFETCH, typename Source>
void amx_pairs(const uint16_t* x, const uint16_t* tail, int64_t M, int64_t K, int64_t panels, const AmxOut& out,
               const Source& source, int64_t t0, int64_t t1) {
  const int64_t pair_bytes = 2 * kAmxPanel * K * 2;
  const int64_t chunk = std::max<int64_t>(1, kAmxChunkBytes / pair_bytes);
  const int64_t full = M / 16 * 16;
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float c[4 * 256];
  static thread_local std::vector<uint16_t> scratch;  // kept across calls: no fresh pages per call
  for (int64_t c0 = t0; c0 < t1; c0 += chunk) {
    const int64_t p0 = 2 * c0, p1 = std::min(panels, 2 * std::min(t1, c0 + chunk));
    const uint16_t* w = source(p0, p1, scratch);
    bool first = PREFETCH;  // only the first row group streams the chunk from DRAM
    int64_t m = 0;
    for (; m + 32 <= full; m += 32, first = false) {
      if (first) amx_rows<true, true>(x + m * K, x + (m + 16) * K, K, w, p0, p1, out, m, c);
      else amx_rows<true, false>(x + m * K, x + (m + 16) * K, K, w, p0, p1, out, m, c);
    }
    if (m < full) {
      if (first) amx_rows<false, true>(x + m * K, nullptr, K, w, p0, p1, out, m, c);
      else amx_rows<false, false>(x + m * K, nullptr, K, w, p0, p1, out, m, c);
      first = false;
    }
    if (full < M) {
      if (first) amx_rows<false, true>(tail, nullptr, K, w, p0, p1, out, full, c);
      else amx_rows<false, false>(tail, nullptr, K, w, p0, p1, out, full, c);
    }
  }
  _tile_release();
}

// The rows of x past the last multiple of 16, copied into 16 zero-padded rows (empty when there are none).
void amx_tail(const uint16_t* x, int64_t M, int64_t K, std::vector<uint16_t>& tail) {
  const int64_t full = M / 16 * 16;
  if (full == M) {
    tail.clear();
    return;
  }
  tail.assign(16 * K, 0);
  std::memcpy(tail.data(), x + full * K, (M - full) * K * sizeof(uint16_t));
}

template <bool PREFETCH, typename Source>
void amx_panels(const uint16_t* x, int64_t M, int64_t K, int64_t panels, const AmxOut& out, const Source& source) {
  std::vector<uint16_t> tail;
  amx_tail(x, M, K, tail);
  at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t t0, int64_t t1) {
    amx_pairs<PREFETCH>(x, tail.data(), M, K, panels, out, source, t0, t1);
  });
}

#pragma GCC push_options
#pragma GCC target("avx512bf16")
// A group's per-row scale (or zero) as the 4 vectors ``dequant_quad`` multiplies by: rows 4j .. 4j + 3,
// each value 4 times (computed once per group, not per step).
struct RowVectors {
  __m512 v[4];
  explicit RowVectors(__m512 s) {
    v[0] = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), s);
    v[1] = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4), s);
    v[2] = _mm512_permutexvar_ps(_mm512_set_epi32(11, 11, 11, 11, 10, 10, 10, 10, 9, 9, 9, 9, 8, 8, 8, 8), s);
    v[3] = _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12), s);
  }
};

// One 64-byte step of 16 rows x 4 weights (int8 codes, or 4-bit codes widened to bytes) -> the two bf16
// pair lines of the panel layout (weights 0, 1 and 2, 3 of each row): w = q (SCALE: x s; ZERO: + z).
template <bool SIGNED, bool SCALE, bool ZERO>
inline void dequant_quad(__m512i bytes, const RowVectors* s, const RowVectors* z, uint16_t* line0,
                         uint16_t* line1) {
  const __m128i part[4] = {_mm512_castsi512_si128(bytes), _mm512_extracti32x4_epi32(bytes, 1),
                           _mm512_extracti32x4_epi32(bytes, 2), _mm512_extracti32x4_epi32(bytes, 3)};
  __m512 f[4];
  for (int j = 0; j < 4; ++j) {  // rows 4j .. 4j + 3, 4 weights each
    f[j] = _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(part[j]) : _mm512_cvtepu8_epi32(part[j]));
    if constexpr (SCALE && ZERO) f[j] = _mm512_fmadd_ps(f[j], s->v[j], z->v[j]);
    else if constexpr (SCALE) f[j] = _mm512_mul_ps(f[j], s->v[j]);
  }
  // as dwords: [row 0 pair 0, row 0 pair 1, row 1 pair 0, ...], rows 0-7 then rows 8-15
  const __m512i h0 = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[1], f[0]));
  const __m512i h1 = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[3], f[2]));
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  _mm512_storeu_si512(line0, _mm512_permutex2var_epi32(h0, even, h1));
  _mm512_storeu_si512(line1, _mm512_permutex2var_epi32(h0, odd, h1));
}

// int8 panels p0 .. p1 ([P, K/4, 16, 4]; scales fp32 [P, K/G, 16]) as bf16 panels. One scale per row
// (G == K) is not applied here: the codes are exact in bf16 and the tile's sums are scaled at the store.
void dequant_int8_panels(const int8_t* q, const float* scales, int64_t K, int64_t G, int64_t p0, int64_t p1,
                         uint16_t* dst) {
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* qp = q + p * kAmxPanel * K;
    uint16_t* out = dst + (p - p0) * kAmxPanel * K;
    if (G == K) {
      for (int64_t k4 = 0; k4 < K / 4; ++k4)
        dequant_quad<true, false, false>(_mm512_loadu_si512(qp + k4 * 64), nullptr, nullptr, out + 2 * k4 * 32,
                                         out + (2 * k4 + 1) * 32);
      continue;
    }
    for (int64_t g = 0; g < K / G; ++g) {
      const RowVectors s(_mm512_loadu_ps(scales + (p * (K / G) + g) * kAmxPanel));
      for (int64_t k4 = g * G / 4; k4 < (g + 1) * G / 4; ++k4)
        dequant_quad<true, true, false>(_mm512_loadu_si512(qp + k4 * 64), &s, nullptr, out + 2 * k4 * 32,
                                        out + (2 * k4 + 1) * 32);
    }
  }
}

// int4 panels p0 .. p1 ([P, K/8, 16, 4] nibbles; scales, zeros fp16 [P, K/G, 16]) as bf16 panels.
void dequant_int4_panels(const uint8_t* q, const uint16_t* scales, const uint16_t* zeros, int64_t K, int64_t G,
                         int64_t p0, int64_t p1, uint16_t* dst) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* qp = q + p * kAmxPanel * K / 2;
    uint16_t* out = dst + (p - p0) * kAmxPanel * K;
    for (int64_t g = 0; g < K / G; ++g) {
      const int64_t at = (p * (K / G) + g) * kAmxPanel;
      const RowVectors s(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + at))));
      const RowVectors z(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(zeros + at))));
      for (int64_t k8 = g * G / 8; k8 < (g + 1) * G / 8; ++k8) {
        const __m512i v = _mm512_loadu_si512(qp + k8 * 64);
        uint16_t* o = out + 4 * k8 * 32;
        dequant_quad<false, true, true>(_mm512_and_si512(v, low), &s, &z, o, o + 32);  // weights 0-3 of the step
        dequant_quad<false, true, true>(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), &s, &z, o + 64, o + 96);
      }
    }
  }
}
#pragma GCC pop_options

void amx_dense_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t panels,
                      const AmxOut& out) {
  amx_panels<true>(x, M, K, panels, out,
                   [&](int64_t p0, int64_t, std::vector<uint16_t>&) { return w + p0 * kAmxPanel * K; });
}

#pragma GCC pop_options

#else
bool amx_ready() { return false; }
#endif

// y [M, P * 16] bf16 = x [M, K] bf16 times P quantized panels, each chunk dequantized by
// ``dequant(p0, p1, dst)`` into bf16 panels; ``col_scale``: per output column, applied at the store.
template <typename Dequant>
torch::Tensor amx_dequantized(const torch::Tensor& x, int64_t P, int64_t K, const float* col_scale,
                              const Dequant& dequant) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == K && x.scalar_type() == at::kBFloat16,
              "x must be a contiguous bf16 [M, ", K, "] tensor");
  TORCH_CHECK(K % 32 == 0 && amx_ready(), "AMX panels need AMX tiles (this CPU or build has none) and K % 32 == 0");
  const int64_t M = x.size(0), N = P * kAmxPanel;
  torch::Tensor y = torch::empty({M, N}, x.options());
#ifdef TANDEM_HAVE_AMX
  amx_panels<false>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, P,
                    AmxOut{y.data_ptr(), true, N, M, col_scale},
                    [&](int64_t p0, int64_t p1, std::vector<uint16_t>& scratch) {
                      scratch.resize((p1 - p0) * kAmxPanel * K);
                      dequant(p0, p1, scratch.data());
                      return static_cast<const uint16_t*>(scratch.data());
                    });
#else
  (void)col_scale;
  (void)dequant;
#endif
  return y;
}

}  // namespace

// Quantized panels through AMX (bf16 activations, x as it is: no int8 rounding): each thread dequantizes
// a chunk of its panels into bf16 in L2 and every row group multiplies it there. From a few rows the
// tile unit outruns the VNNI loops (``int8_matmul_panel``), whose cost grows with every row.
torch::Tensor int8_matmul_panel_amx(torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t group_size) {
  check_panels(q, 4, group_size, q.size(1) * 4);
  TORCH_CHECK(q.scalar_type() == at::kChar, "q must be int8 [N/16, K/4, 16, 4]");
  const int64_t P = q.size(0), N = P * kAmxPanel, K = q.size(1) * 4, G = group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / G),
              "scales must be contiguous fp32 [N] (one per row) or [N/16, K/group_size, 16]");
  const auto* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  return amx_dequantized(x, P, K, G == K ? sp : nullptr, [&](int64_t p0, int64_t p1, uint16_t* dst) {
#ifdef TANDEM_HAVE_AMX  // (other builds refuse in amx_dequantized)
    dequant_int8_panels(qp, sp, K, G, p0, p1, dst);
#else
    (void)p0, (void)p1, (void)dst, (void)qp, (void)sp;
#endif
  });
}

torch::Tensor int4_matmul_panel_amx(torch::Tensor x, torch::Tensor q, torch::Tensor scales, torch::Tensor zeros,
                                    int64_t group_size) {
  check_panels(q, 8, group_size, q.size(1) * 8);
  TORCH_CHECK(q.scalar_type() == at::kByte, "q must be uint8 [N/16, K/8, 16, 4]");
  const int64_t P = q.size(0), N = P * kAmxPanel, K = q.size(1) * 8, G = group_size;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && zeros.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  zeros.is_contiguous() && scales.numel() == N * (K / G) && zeros.numel() == scales.numel(),
              "scales, zeros must be contiguous fp16 [N/16, K/group_size, 16]");
  const auto* qp = q.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* zp = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::Half>());
  return amx_dequantized(x, P, K, nullptr, [&](int64_t p0, int64_t p1, uint16_t* dst) {
#ifdef TANDEM_HAVE_AMX  // (other builds refuse in amx_dequantized)
    dequant_int4_panels(qp, sp, zp, K, G, p0, p1, dst);
#else
    (void)p0, (void)p1, (void)dst, (void)qp, (void)sp, (void)zp;
#endif
  });
}

