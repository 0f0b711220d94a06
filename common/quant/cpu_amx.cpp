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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__linux__) && defined(__GNUC__) && \
    (__GNUC__ >= 11 || defined(__clang__))
#define TANDEM_HAVE_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kAmxPanel = 16;  // output rows per panel (common/quant/panels.py's PANEL_ROWS)

#ifdef TANDEM_HAVE_AMX

constexpr int64_t kAmxPrefetch = 4096;  // bytes ahead of a panel's tile that its first pass prefetches
constexpr int64_t kAmxChunkBytes = 256 << 10;  // weights a thread holds in L2 while every row group passes

bool amx_ready() {
  static const bool ready = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;  // CPUID.(7,0):EDX AMX-TILE, AMX-BF16
    if (!tile || !bf16) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The output: bf16 [M, N] rounded from the tiles' fp32 sums (round to nearest even, as ``Out::finish``),
// or fp32 [M, N] as they are; rows from ``rows`` on (the padding of the last group) are dropped.
struct AmxOut {
  void* y;
  bool bf16;
  int64_t N, M;
};

#pragma GCC push_options
#pragma GCC target("avx512bf16")
inline void amx_store(const float* c, const AmxOut& out, int64_t m, int64_t col) {
  const int64_t rows = std::min<int64_t>(16, out.M - m);
  if (out.bf16) {
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

// Row group m (32 rows at xa, xb = xa + 16 rows; or 16 rows at xa) over panel pairs [c0, c1).
template <bool ROWS2, bool PF>
inline void amx_rows(const uint16_t* xa, const uint16_t* xb, int64_t K, const uint16_t* w, int64_t panels,
                     const AmxOut& out, int64_t m, int64_t c0, int64_t c1, float* c) {
  for (int64_t t = c0; t < c1; ++t) {
    const int64_t p = 2 * t;
    const uint16_t* b0 = w + p * kAmxPanel * K;
    if (p + 1 < panels) amx_tile<ROWS2, true, PF>(xa, xb, K, b0, out, p, m, c);
    else amx_tile<ROWS2, false, PF>(xa, xb, K, b0, out, p, m, c);
  }
}

// out [M, N] = x [M, K] bf16 (K a multiple of 32) times the panels w [N/16, K/2, 16, 2]. Rows go in groups
// of 32, then 16; the last partial group is copied into 16 zero-padded rows. A thread takes its panel
// pairs in chunks of ``kAmxChunkBytes`` of weights: the first row group pulls a chunk from DRAM into L2,
// the others read it there, and each row group's x stays in L1 while it passes over the chunk.
void amx_dense_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t panels,
                      const AmxOut& out) {
  const int64_t pair_bytes = 2 * kAmxPanel * K * 2;
  const int64_t chunk = std::max<int64_t>(1, kAmxChunkBytes / pair_bytes);
  const int64_t full = M / 16 * 16;
  std::vector<uint16_t> tail;
  if (full < M) {
    tail.assign(16 * K, 0);
    std::memcpy(tail.data(), x + full * K, (M - full) * K * sizeof(uint16_t));
  }
  at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t t0, int64_t t1) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    alignas(64) float c[4 * 256];
    for (int64_t c0 = t0; c0 < t1; c0 += chunk) {
      const int64_t c1 = std::min(t1, c0 + chunk);
      // the first row group streams the chunk from DRAM (prefetching), the others find it in L2
      int64_t m = 0;
      bool first = true;
      for (; m + 32 <= full; m += 32, first = false) {
        if (first) amx_rows<true, true>(x + m * K, x + (m + 16) * K, K, w, panels, out, m, c0, c1, c);
        else amx_rows<true, false>(x + m * K, x + (m + 16) * K, K, w, panels, out, m, c0, c1, c);
      }
      if (m < full) {
        if (first) amx_rows<false, true>(x + m * K, nullptr, K, w, panels, out, m, c0, c1, c);
        else amx_rows<false, false>(x + m * K, nullptr, K, w, panels, out, m, c0, c1, c);
        first = false;
      }
      if (full < M) {
        if (first) amx_rows<false, true>(tail.data(), nullptr, K, w, panels, out, full, c0, c1, c);
        else amx_rows<false, false>(tail.data(), nullptr, K, w, panels, out, full, c0, c1, c);
      }
    }
    _tile_release();
  });
}

#pragma GCC pop_options

#else
bool amx_ready() { return false; }
#endif

}  // namespace
