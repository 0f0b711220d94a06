// ``dense_matmul``: cpu_quant.cpp's GEMV tiling for float weights (fp32 or bf16 [N, K]), for decode-size batches of
// unquantized models: oneDNN / MKL stream a small layer's weights at about half the read bandwidth on two
// cores; prefetching the next tiles' rows gets close to it.

namespace {

// fp32 weights load as they are. bf16 weights load 2*VL at a time as VL 32-bit lanes, each holding an even
// element (low half) and an odd one (high half): the odd ones are the lanes with the low half masked off,
// the even ones the lanes shifted left by 16 - two plain ALU ops per 2*VL weights, no widening shuffles.
// x is read in the matching order (``pair_lanes``: per 2*VL elements, the even ones then the odd ones).
inline void wload2(const float* p, vf& a, vf& b) {
  a = vload(p);
  b = vload(p + VL);
}
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline void wload2(const at::BFloat16* p, vf& even, vf& odd) {
  const __m512i raw = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#elif defined(__AVX2__)
inline void wload2(const at::BFloat16* p, vf& even, vf& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#else
inline void wload2(const at::BFloat16* p, vf& even, vf& odd) {
  even = static_cast<float>(p[0]);
  odd = static_cast<float>(p[1]);
}
#endif

// x [M, K] in the order ``wload2`` gives bf16 weights in, over the SUB-multiple body of each row.
void pair_lanes(const float* x, int64_t M, int64_t K, std::vector<float>& out) {
  const int64_t body = K - K % SUB;
  out.assign(x, x + M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < body; k += 2 * VL)
      for (int j = 0; j < VL; ++j) {
        out[m * K + k + j] = x[m * K + k + 2 * j];
        out[m * K + k + VL + j] = x[m * K + k + 2 * j + 1];
      }
}

// How far ahead of a tile the dense GEMV prefetches: 32 KiB measured best for bf16 (19.0 vs 16.4 GB/s
// without), neutral for fp32 (2 threads, AVX-512 EPYC).
constexpr int64_t kDensePrefetchBytes = 32768;
// R weight rows x MT activation rows, K in steps of SUB (a scalar tail for the rest), fp32 sums.
// x: as pair_lanes orders it for bf16 weights, as it is for fp32; x_tail: x as it is (the tail's columns).
template <int R, int MT, typename w_t>
void dense_tile(const float* x, const float* x_tail, int64_t K, const w_t* w, int64_t n0, float* y, int64_t ldy) {
  vf acc[R][MT][NV];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < NV; ++v) acc[r][m][v] = vzero();
  const w_t* rows = w + n0 * K;
  const char* ahead = reinterpret_cast<const char*>(rows) + kDensePrefetchBytes;
  const int64_t body = K - K % SUB;
  constexpr int64_t kBytes = SUB * sizeof(w_t);
  for (int64_t k = 0; k < body; k += SUB) {
    for (int r = 0; r < R; ++r) {
      const w_t* wr = rows + r * K + k;
      for (int64_t off = 0; off < kBytes; off += 64) prefetch(ahead + (r * K + k) * sizeof(w_t) + off);
      vf wv[NV];
      for (int v = 0; v < NV; v += 2) wload2(wr + v * VL, wv[v], wv[v + 1]);
      for (int m = 0; m < MT; ++m)
        for (int v = 0; v < NV; ++v) acc[r][m][v] = vfma(wv[v], vload(x + m * K + k + v * VL), acc[r][m][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      float total = 0.f;
      for (int v = 0; v < NV; ++v) total += vsum(acc[r][m][v]);
      for (int64_t k = body; k < K; ++k) total += static_cast<float>(rows[r * K + k]) * x_tail[m * K + k];
      y[m * ldy + n0 + r] = total;
    }
}

// rows n0 .. n0 + rows of y for activation rows m0 .. m0 + MT, in tiles of as many rows as MT allows.
template <int MT, typename w_t>
void dense_rows(const float* x, const float* x_tail, const w_t* w, int64_t K, int64_t N, float* y, int64_t m0,
                int64_t n0, int64_t rows) {
  constexpr int R = rows_for<MT>();
  int64_t n = n0;
  for (; n + R <= n0 + rows; n += R) dense_tile<R, MT>(x + m0 * K, x_tail + m0 * K, K, w, n, y + m0 * N, N);
  for (; n < n0 + rows; ++n) dense_tile<1, MT>(x + m0 * K, x_tail + m0 * K, K, w, n, y + m0 * N, N);
}

// Weight rows n0 .. n0 + rows times all M activation rows, in groups of 4, 2, 1 over the tile while it is in L1
// (``dense_all``'s tile; the one-call decode step, cpu_step.cpp, runs the same tiles on its share of the rows).
template <typename w_t>
void dense_span(const float* x, const float* x_tail, const w_t* w, int64_t M, int64_t K, int64_t N, float* y,
                int64_t n0, int64_t rows) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dense_rows<4>(x, x_tail, w, K, N, y, m, n0, rows);
  for (; m + 2 <= M; m += 2) dense_rows<2>(x, x_tail, w, K, N, y, m, n0, rows);
  for (; m < M; ++m) dense_rows<1>(x, x_tail, w, K, N, y, m, n0, rows);
}

// One pass over the weights whatever M is: each tile of rows is read from DRAM once and every group of
// activation rows (4, 2, 1) multiplies it while it is in L1 (a pass per group streamed it again: a
// speculative verification of 5 rows cost two passes). A row's result does not depend on its group.
template <typename w_t>
void dense_all(const float* x, const float* x_tail, const w_t* w, int64_t M, int64_t K, int64_t N, float* y) {
  constexpr int R = rows_for<1>();
  const auto tile = [&](int64_t n0, int64_t rows) { dense_span(x, x_tail, w, M, K, N, y, n0, rows); };
  run_tiles(M, N, R, [&](int64_t n0) { tile(n0, R); }, [&](int64_t n) { tile(n, 1); });
}

}  // namespace

torch::Tensor dense_matmul(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "w must be a contiguous [N, K] tensor");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "w must be float32 or bfloat16");
  const int64_t N = w.size(0), K = w.size(1);
  std::vector<float> xs;
  const float* xp = float_x(x, K, xs);
  const int64_t M = x.size(0);
  Out out(x, M, N);
  if (w.scalar_type() == at::kFloat) {
    dense_all(xp, xp, w.data_ptr<float>(), M, K, N, out.data);
  } else {
    std::vector<float> lanes;
    pair_lanes(xp, M, K, lanes);
    dense_all(lanes.data(), xp, w.data_ptr<at::BFloat16>(), M, K, N, out.data);
  }
  return out.finish();
}

// ``dense_matmul_panel``: float weights in 16-row panels (common/model/gemv.py's ``PanelLinear``):
//
//   bf16 w [N/16, K/2, 16, 2]: panel, pair of weights, output row, the row's 2 weights (what
//        ``vdpbf16ps`` multiplies by a broadcast pair of x);
//   fp32 w [N/16, K, 16]:      panel, weight, output row.
//
// A thread streams whole panels (one contiguous run of bytes each), every row group of x multiplies the
// tile while it is in L1, and no horizontal sums are needed: measured on 30 layers of SmolLM2's shapes,
// 2 threads, bf16: batch 1 9.8 -> 6.8 ms (31 GB/s, the read bandwidth), 8 rows 21 -> 8 ms, 64 rows 48.7
// (oneDNN) -> 41.5 ms; from about 256 rows oneDNN's GEMM is faster (the layer unpacks tiles for it).
// AVX512-BF16 runs ``vdpbf16ps`` (chosen at run time); other builds widen bf16 pairs as ``wload2`` does
// (even rows' lane, odd lane) and multiply-add in fp32. A row's result does not depend on the rows beside it.

namespace {

constexpr int64_t kDensePanel = 16;

#if defined(__AVX512F__) && defined(__AVX512BW__)
#pragma GCC push_options
#pragma GCC target("avx512bf16")
// Pairs k2 of [k0, k1) of MR rows x NV panels; ``first``: start from zero, else from y (K is blocked so a
// tile's weights stay in L1 while every row group passes over them).
template <int MR, int NV>
void dense_panel_tile_bf16(const uint16_t* x, int64_t K, const uint16_t* w, float* y, int64_t N, int64_t p0,
                           int64_t k0, int64_t k1, bool first) {
  const int64_t stride = kDensePanel * K;  // elements per panel
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v)
      acc[m][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + m * N + (p0 + v) * kDensePanel);
  const uint16_t* w0 = w + p0 * stride;
  for (int64_t k2 = k0; k2 < k1; ++k2) {
    __m512bh wv[NV];
    for (int v = 0; v < NV; ++v) {
      prefetch(w0 + v * stride + k2 * 32 + 512);
      wv[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w0 + v * stride + k2 * 32));
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + 2 * k2, sizeof(pair));
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], wv[v], xb);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(y + m * N + (p0 + v) * kDensePanel, acc[m][v]);
}
#pragma GCC pop_options

// The 1-7 rows left after the 8-row tiles, in one tile of their own count: one row at a time (the loop
// before) ran 2 chains of dependent ``vdpbf16ps`` a pass, bound by the instruction's latency, not its rate.
// A row's sums are the same floats in any tile (pairs ascending, one ``vdpbf16ps`` each).
template <int MR, int NV>
void bf16_tail(int64_t rows, const uint16_t* x, int64_t K, const uint16_t* w, float* y, int64_t N, int64_t p0,
               int64_t k0, int64_t k1, bool first) {
  if constexpr (MR > 0) {
    if (rows == MR) return dense_panel_tile_bf16<MR, NV>(x, K, w, y, N, p0, k0, k1, first);
    bf16_tail<MR - 1, NV>(rows, x, K, w, y, N, p0, k0, k1, first);
  }
}

// y [M, N] fp32 = x [M, K] bf16 times the panel pairs [t0, t1) of bf16 panels (``vdpbf16ps``), on the calling
// thread: what ``dense_matmul_panel`` runs per thread, and common/kernels/cpu/cpu_step.cpp's step over its own split
// (a panel's sums do not depend on which thread takes it).
constexpr int kDenseNV = 2;  // panels a tile
void dense_bf16_pairs(const uint16_t* xp, int64_t M, int64_t K, const uint16_t* wp, float* y, int64_t N,
                      int64_t panels, int64_t t0, int64_t t1) {
  constexpr int NV = kDenseNV;
  constexpr int64_t kPairsPerBlock = 256;  // K block: 2 panels x 512 weights x 2 bytes = 32 KiB, one L1
  const int64_t pairs = K / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t p = t * NV;
    const bool full = p + NV <= panels;
    for (int64_t k0 = 0; k0 < pairs; k0 += kPairsPerBlock) {
      const int64_t k1 = std::min(pairs, k0 + kPairsPerBlock);
      const bool first = k0 == 0;
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) {
        if (full) dense_panel_tile_bf16<8, NV>(xp + m * K, K, wp, y + m * N, N, p, k0, k1, first);
        else dense_panel_tile_bf16<8, 1>(xp + m * K, K, wp, y + m * N, N, p, k0, k1, first);
      }
      if (m < M) {
        if (full) bf16_tail<7, NV>(M - m, xp + m * K, K, wp, y + m * N, N, p, k0, k1, first);
        else bf16_tail<7, 1>(M - m, xp + m * K, K, wp, y + m * N, N, p, k0, k1, first);
      }
    }
  }
}
#endif

// Any build: fp32 sums of widened weights. VL output rows a vector (16 rows = 16 / VL vectors).
template <int MR, bool BF16>
void dense_panel_tile_fma(const float* x, int64_t K, const void* wv, float* y, int64_t N, int64_t p) {
  constexpr int PV = kDensePanel / VL;  // vectors per panel
  vf acc[MR][PV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < PV; ++v) acc[m][v] = vzero();
  if constexpr (BF16) {
    const at::BFloat16* w0 = static_cast<const at::BFloat16*>(wv) + p * kDensePanel * K;
    for (int64_t k2 = 0; k2 < K / 2; ++k2) {
      for (int v = 0; v < PV; ++v) {
        vf even, odd;  // weight 2 k2 and 2 k2 + 1 of VL rows
        wload2(w0 + k2 * 2 * kDensePanel + v * 2 * VL, even, odd);
        for (int m = 0; m < MR; ++m) {
          acc[m][v] = vfma(even, vset1(x[m * K + 2 * k2]), acc[m][v]);
          acc[m][v] = vfma(odd, vset1(x[m * K + 2 * k2 + 1]), acc[m][v]);
        }
      }
    }
  } else {
    const float* w0 = static_cast<const float*>(wv) + p * kDensePanel * K;
    for (int64_t k = 0; k < K; ++k)
      for (int v = 0; v < PV; ++v) {
        const vf wk = vload(w0 + k * kDensePanel + v * VL);
        for (int m = 0; m < MR; ++m) acc[m][v] = vfma(wk, vset1(x[m * K + k]), acc[m][v]);
      }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < PV; ++v) vstore(y + m * N + p * kDensePanel + v * VL, acc[m][v]);
}

// Rows a tile multiplies per pass over a panel (AVX2: 8 accumulators and 4 broadcasts of 16 ymm; 6 rows
// measured 1.5x slower at 12-48 rows on a Zen 3: its broadcasts spill).
constexpr int kDenseRows = 4;

template <int MR, bool BF16>
void dense_panel_tail(int64_t rows, const float* x, int64_t K, const void* w, float* y, int64_t N, int64_t p) {
  if constexpr (MR > 0) {
    if (rows == MR) return dense_panel_tile_fma<MR, BF16>(x, K, w, y, N, p);
    dense_panel_tail<MR - 1, BF16>(rows, x, K, w, y, N, p);
  }
}

// Rows [m0, m1) of x times panel p: tiles of kDenseRows rows, then the rows left in one tile of their own
// count. A tile passes over the whole panel (16 x K weights, more than L1 holds from K = 512 on a 32 KB L1),
// so the leftover rows one at a time (the loop before) read it once per row: 2-core AVX2 EPYC, fp32, SmolLM2's
// four projections, 7 rows 0.82 ms a layer against 8 rows' 0.61 (session 36). A row's sums are the same floats
// in any tile (k ascending, one multiply-add each).
template <bool BF16>
void dense_panel_rows(const float* x, int64_t m0, int64_t m1, int64_t K, const void* w, float* y, int64_t N,
                      int64_t p) {
  int64_t m = m0;
  for (; m + kDenseRows <= m1; m += kDenseRows)
    dense_panel_tile_fma<kDenseRows, BF16>(x + m * K, K, w, y + m * N, N, p);
  if (m < m1) dense_panel_tail<kDenseRows - 1, BF16>(m1 - m, x + m * K, K, w, y + m * N, N, p);
}

// Panels [p0, p1) of fp32 (``BF16`` false) or bf16 panels times x [M, K] fp32, fp32 sums into y, on the
// calling thread: the loop for CPUs without AVX512-BF16, and every CPU's for fp32 panels.
template <bool BF16>
void dense_fma_span(const float* x, int64_t M, int64_t K, const void* w, float* y, int64_t N, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) dense_panel_rows<BF16>(x, 0, M, K, w, y, N, p);
}

}  // namespace

// Which loop ``dense_matmul_panel`` runs for bf16 panels on this CPU: amx (from ``amx_min_rows`` rows;
// ``vdpbf16ps`` below), avx512bf16, or fma (fp32 multiply-adds of widened weights).
std::string dense_panel_path() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (amx_ready()) return "amx";
  if (tandem_amx::bf16_dot()) return "avx512bf16";
#endif
  return "fma";
}

torch::Tensor dense_matmul_panel(torch::Tensor x, torch::Tensor w, int64_t amx_min_rows, bool float_out) {
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(w.is_contiguous() && ((bf16 && w.dim() == 4 && w.size(2) == kDensePanel && w.size(3) == 2) ||
                                    (w.scalar_type() == at::kFloat && w.dim() == 3 && w.size(2) == kDensePanel)),
              "w must be contiguous bf16 [N/16, K/2, 16, 2] or fp32 [N/16, K, 16]");
  const int64_t panels = w.size(0), N = panels * kDensePanel, K = bf16 ? w.size(1) * 2 : w.size(1);
  const int64_t M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == K, "x must be a contiguous [M, ", K, "] tensor");
#ifdef TANDEM_HAVE_AMX
  if (bf16 && x.scalar_type() == at::kBFloat16 && M >= amx_min_rows && K % 32 == 0 && amx_ready()) {
    torch::Tensor y = torch::empty({M, N}, float_out ? x.options().dtype(at::kFloat) : x.options());
    amx_dense_panels(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K,
                     reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), panels,
                     AmxOut{y.data_ptr(), !float_out, N, M});
    return y;
  }
#endif
  Out out(x, M, N, float_out);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (bf16 && x.scalar_type() == at::kBFloat16 && tandem_amx::bf16_dot()) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    at::parallel_for(0, (panels + kDenseNV - 1) / kDenseNV, 1, [&](int64_t t0, int64_t t1) {
      dense_bf16_pairs(xp, M, K, wp, out.data, N, panels, t0, t1);
    });
    return out.finish();
  }
#endif
  std::vector<float> xs;
  const float* xp = float_x(x, K, xs);
  const void* wp = w.data_ptr();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    if (bf16) dense_fma_span<true>(xp, M, K, wp, out.data, N, p0, p1);
    else dense_fma_span<false>(xp, M, K, wp, out.data, N, p0, p1);
  });
  return out.finish();
}
