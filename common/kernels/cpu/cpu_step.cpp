// A decode step's decoder layers in one call: the whole layer stack for a few decode rows, in one OpenMP
// parallel region.
//
// At batch 1 a step of the bundled model makes ~400 calls from Python (norms, projections, rotary and the
// K/V write, attention, SiLU; 30 layers), each a Python frame, a dispatch, an allocation and, for the
// kernels that split work over threads, a fork and a join of the thread team: measured 2.2 ms of Python
// and small ops plus ~3 us a projection around 4.3 ms of int4 matrices (2-core EPYC, AVX2). Here the plan
// (every layer's weights and K/V cache) is handed over once, and a step is one call: the threads stay in
// one parallel region and meet at a barrier between the parts of a layer. The arithmetic is the very
// kernels the op-by-op path calls (this module's source is those files, each in its own namespace, built
// with their flags; attention is called in its own module), on the same data in the same order, so the
// hidden states and the K/V written are bit-identical to it
// (tests/model/test_decode_step.py): speculative verification, which keeps the op-by-op path, still
// sees exactly the rows plain decoding produced.
//
// A layer: add_rms_norm -> qkv -> rotary + K/V write -> attention -> o -> add_rms_norm -> gate_up ->
// SiLU * up -> down. Projections split their 16-row panels over the threads (a panel's rows are computed
// by one thread whatever the split: the results do not depend on it), attention splits (row, KV head)
// pairs; the small elementwise parts run on one thread (a few hundred floats a row).
//
// Weights and activations: fp32 activations with fp32 panels (common/model/gemv.py's PanelMethod), row-major
// fp32 weights (its GemvMethod, where panels do not pay: dense_matmul's tiles, split by rows), or int8 /
// int4 panels with int8-rounded activations (common/quant/cpu_linear.py's tandem_a8 layers), the dtype
// `--dtype auto` chooses where bf16 is slow (AVX2); or bf16 activations with bf16 panels, multiplied as
// dense_matmul_panel does on this CPU (AMX tiles from its row threshold, ``vdpbf16ps`` below it, fp32
// multiply-adds of widened weights without AVX512-BF16), or int8 / int4 panels as the tandem_a8 layers
// multiply bf16 rows (chunks dequantized into AMX tiles from their row threshold, else the int8-rounded
// rows), rounding to bf16 at the same points. Up to MAX_ROWS rows, each one decode token of its own
// sequence.

namespace tstep {

constexpr int64_t MAX_ROWS = 256;  // a bound on the buffers; Python sets each model's own (decode_step.py)
constexpr int64_t kSplitRows = 8;  // from this many rows the elementwise parts split over the threads
enum Kind : int64_t { kInt4 = 4, kInt8 = 8, kBFloat16 = 16, kFloat32 = 32, kRowFloat32 = 33 };

struct Linear {
  int64_t kind = 0, N = 0, K = 0, G = 0;
  // fp32 panels [N/16, K, 16] | row-major fp32 [N, K] | bf16 panels [N/16, K/2, 16, 2] | int q panels, scales, zeros
  torch::Tensor w, s, z;
  int64_t panels() const { return N / 16; }
};

struct Layer {
  torch::Tensor norm1, norm2, kc, vc;
  Linear qkv, o, gate_up, down;
};

// common/kernels/cpu/cpu_decode.cpp's decode_rows<scalar_t>, in the attention module: attention is that
// module's compiled code (its own flags: -ffast-math's vector exp), so the rows equal paged_decode's.
template <typename scalar_t>
using AttentionFn = void (*)(const scalar_t*, const scalar_t*, const scalar_t*, const int64_t*, const int64_t*,
                             const int32_t*, int64_t, const int64_t*, scalar_t*, int64_t, int64_t, int64_t, int64_t,
                             float, int64_t, int64_t, int64_t, int64_t);

struct Plan {
  std::vector<Layer> layers;
  bool bf16 = false;  // activations, norms and K/V in bf16 (else fp32)
  int64_t amx_min_rows = 0;  // bf16 panels: AMX tiles from this many rows (dense_matmul_panel's threshold)
  int64_t amx_quant_min_rows = 0;  // int8 / int4 panels with bf16 activations: dequantized into AMX tiles from here
  void* attention = nullptr;  // AttentionFn<float> or AttentionFn<c10::BFloat16>
  bool splits_heads = false;  // the attention function takes one KV head at a time
  torch::Tensor final_norm;
  float eps = 0.f;
  double scale = 0.;
  // Profiling (decode_step_profile): wall seconds of the projections, of attention, and of the rest, summed
  // over runs as thread 0 sees them (a part ends at the barrier after it, so waiting for the slower
  // thread counts in it).
  bool profile = false;
  double seconds[3] = {0., 0., 0.};
  int64_t hidden = 0, Hq = 0, Hkv = 0, D = 0, inter = 0;
};

std::mutex plans_lock;
std::vector<std::unique_ptr<Plan>> plans;  // handle = index; freed slots are null

Linear make_linear(const torch::Tensor& w, const torch::Tensor& s, const torch::Tensor& z, int64_t kind, int64_t G,
                   int64_t N, int64_t K, const char* name) {
  Linear l{kind, N, K, G, w, s, z};
  if (kind == kRowFloat32) {
    TORCH_CHECK(w.is_contiguous() && w.dim() == 2 && w.scalar_type() == at::kFloat && w.size(0) == N &&
                    w.size(1) == K, name, ": row-major fp32 weights [N, K], contiguous");
    return l;
  }
  TORCH_CHECK(N % 16 == 0, name, ": out_features must be a multiple of 16");
  TORCH_CHECK(w.is_contiguous() && w.dim() == (kind == kFloat32 ? 3 : 4) && w.size(0) == N / 16, name,
              ": weights must be contiguous 16-row panels");
  if (kind == kFloat32) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.size(1) == K && w.size(2) == 16, name, ": fp32 panels [N/16, K, 16]");
  } else if (kind == kBFloat16) {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(1) * 2 == K && w.size(2) == 16 && w.size(3) == 2, name,
                ": bf16 panels [N/16, K/2, 16, 2]");
  } else if (kind == kInt8) {
    TORCH_CHECK(w.scalar_type() == at::kChar && w.size(1) * 4 == K, name, ": int8 panels [N/16, K/4, 16, 4]");
    TORCH_CHECK(G % 32 == 0 && K % G == 0 && s.scalar_type() == at::kFloat && s.is_contiguous() &&
                    s.numel() == N * (K / G), name, ": int8 scales fp32, group a multiple of 32 dividing K");
  } else if (kind == kInt4) {
    TORCH_CHECK(w.scalar_type() == at::kByte && w.size(1) * 8 == K, name, ": int4 panels [N/16, K/8, 16, 4]");
    TORCH_CHECK(G % 32 == 0 && K % G == 0 && s.scalar_type() == at::kHalf && z.scalar_type() == at::kHalf &&
                    s.is_contiguous() && z.is_contiguous() && s.numel() == N * (K / G) && z.numel() == s.numel(),
                name, ": int4 scales and zeros fp16 [N/16, K/G, 16]");
  } else {
    TORCH_CHECK(false, name, ": unknown weight kind ", kind);
  }
  return l;
}

// How a projection with bf16 activations multiplies on this CPU for M rows, as its op-by-op kernel
// chooses: bf16 panels as dense_matmul_panel (AMX tiles, vdpbf16ps, or fp32 multiply-adds of widened
// weights); int8 / int4 panels as the tandem_a8 layers (chunks dequantized into AMX tiles from their row
// threshold, else the int8-rounded rows through the integer panel loop: kA8).
enum class Bf16Path { kAmx, kDot, kFma, kA8 };

Bf16Path bf16_path(const Plan& p, const Linear& l, int64_t M) {
  const bool packed = l.kind == kInt4 || l.kind == kInt8;
#ifdef TANDEM_HAVE_AMX
  if (M >= (packed ? p.amx_quant_min_rows : p.amx_min_rows) && l.K % 32 == 0 && tq::amx_ready()) return Bf16Path::kAmx;
#else
  (void)p;
  (void)M;
#endif
  if (packed) return Bf16Path::kA8;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (tandem_amx::bf16_dot()) return Bf16Path::kDot;
#endif
  return Bf16Path::kFma;
}

// One projection's input, prepared once by one thread: int8 rounding for the packed kinds; for bf16 panels
// the path, and the widened rows (no AVX512-BF16) or the zero-padded last rows (AMX).
struct Input {
  const float* x = nullptr;
  const uint16_t* xb = nullptr;
  tq::QuantX xq;
  Bf16Path path = Bf16Path::kFma;
  std::vector<float> xf;
  std::vector<uint16_t> tail;
};

// Whether a projection's input needs work per layer (else ``bind`` alone prepares it, once a run).
bool needs_prepare(const Plan& p, const Linear& l, const Input& in, int64_t M) {
  if (!p.bf16) return l.kind != kFloat32 && l.kind != kRowFloat32;
  return in.path == Bf16Path::kFma || in.path == Bf16Path::kA8 || (in.path == Bf16Path::kAmx && M % 16 != 0);
}

// What every layer's input of this projection shares: its buffer (the same for every layer) and its path.
void bind(const Plan& p, const Linear& l, const float* x, int64_t M, Input& in) {
  (void)p;
  (void)l;
  (void)M;
  in.x = x;
}

void bind(const Plan& p, const Linear& l, const uint16_t* x, int64_t M, Input& in) {
  in.xb = x;
  in.path = bf16_path(p, l, M);
}

// The per-layer work: int8 rounding (packed kinds: of the widened rows with bf16 activations), widened rows
// (bf16 panels without AVX512-BF16), the zero-padded last rows (AMX).
void prepare(const Plan& p, const Linear& l, int64_t M, Input& in) {
  if (!p.bf16) {
    if (l.kind != kFloat32 && l.kind != kRowFloat32) tq::quantize_x(in.x, M, l.K, l.G, in.xq);
    return;
  }
  if (in.path == Bf16Path::kFma || in.path == Bf16Path::kA8) {
    in.xf.resize(M * l.K);
    for (int64_t i = 0; i < M * l.K; ++i) in.xf[i] = tf::BF16::in(in.xb[i]);
    if (in.path == Bf16Path::kA8) tq::quantize_x(in.xf.data(), M, l.K, l.G, in.xq);
  }
#ifdef TANDEM_HAVE_AMX
  if (in.path == Bf16Path::kAmx) tq::amx_tail(in.xb, M, l.K, in.tail);
#endif
}

}  // namespace tstep

namespace tq {

// Rows [0, M) x panels [p0, p1) of a packed panel product, on the calling thread: the tiles
// panel_matmul runs, over a part of the panels (a panel's rows come out the same whichever thread does it).
template <bool INT4>
void panel_span(const PanelArgs& a, int64_t M, int64_t p0, int64_t p1) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (cpu_has_vnni()) {
    for (int64_t p = p0; p < p1; p += 3)
      for (int64_t m = 0; m < M; m += 4)
        Dispatch<4, 3, INT4, VnniTile>::run(a, m, p, std::min<int64_t>(4, M - m), std::min<int64_t>(3, p1 - p));
    return;
  }
#endif
#if defined(__AVX2__)
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t m = 0; m < M; m += 2) Dispatch<2, 1, INT4, Avx2Tile>::run(a, m, p, std::min<int64_t>(2, M - m), 1);
#else
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t m = 0; m < M; ++m) panel_tile_generic<INT4>(a, m, p);
#endif
}

}  // namespace tq

namespace tstep {

// This thread's share [begin, end) of n items.
inline void share(int64_t n, int tid, int nt, int64_t& begin, int64_t& end) {
  begin = n * tid / nt;
  end = n * (tid + 1) / nt;
}

// Columns [c0, c1) of M rows of fp32 sums, rounded to bf16 (round to nearest even, as dense_matmul_panel's
// Out::finish).
void round_columns(const float* src, uint16_t* dst, int64_t M, int64_t N, int64_t c0, int64_t c1) {
  for (int64_t m = 0; m < M; ++m) {
    auto* d = reinterpret_cast<at::BFloat16*>(dst + m * N);
    const float* f = src + m * N;
    int64_t c = c0;
    for (; c + tq::VL <= c1; c += tq::VL) tq::vstore(d + c, tq::vload(f + c));
    for (; c < c1; ++c) d[c] = at::BFloat16(f[c]);
  }
}

// This thread's panels of a projection: y (the activation dtype) = x times the weights. ``scratch``: fp32
// [M, N] sums for bf16 panels that do not go through AMX (rounded into y for this thread's columns).
// Panels [p0, p1) of an int8 / int4 projection: fp32 sums into y [M, N] from the int8-rounded rows.
void packed_span(const Linear& l, const Input& in, int64_t M, float* y, int64_t p0, int64_t p1) {
  const bool int4 = l.kind == kInt4;
  const tq::PanelArgs args{in.xq, l.K, l.G, l.N, static_cast<const uint8_t*>(l.w.data_ptr()),
                           int4 ? nullptr : l.s.data_ptr<float>(),
                           int4 ? reinterpret_cast<const uint16_t*>(l.s.data_ptr<at::Half>()) : nullptr,
                           int4 ? reinterpret_cast<const uint16_t*>(l.z.data_ptr<at::Half>()) : nullptr,
                           !int4 && l.G == l.K, y};
  if (int4) tq::panel_span<true>(args, M, p0, p1);
  else tq::panel_span<false>(args, M, p0, p1);
}

// This thread's rows of a row-major fp32 projection: dense_matmul's tiles (``dense_span``), over a share of them.
void rows_part(const Linear& l, const Input& in, int64_t M, float* y, int tid, int nt) {
  constexpr int64_t R = tq::rows_for<1>();
  int64_t t0, t1;
  share((l.N + R - 1) / R, tid, nt, t0, t1);
  const float* w = l.w.data_ptr<float>();
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * R;
    tq::dense_span(in.x, in.x, w, M, l.K, l.N, y, n0, std::min(R, l.N - n0));
  }
}

void matmul_part(const Linear& l, const Input& in, int64_t M, float* y, float* scratch, int tid, int nt) {
  (void)scratch;
  if (l.kind == kRowFloat32) {
    rows_part(l, in, M, y, tid, nt);
    return;
  }
  int64_t p0, p1;
  share(l.panels(), tid, nt, p0, p1);
  if (p0 >= p1) return;
  if (l.kind == kFloat32) tq::dense_fma_span<false>(in.x, M, l.K, l.w.data_ptr(), y, l.N, p0, p1);
  else packed_span(l, in, M, y, p0, p1);
}

#ifdef TANDEM_HAVE_AMX
// Panel pairs [t0, t1) of an int8 / int4 projection through AMX: each chunk dequantized into bf16 panels
// (the thread's scratch), as int8_matmul_panel_amx / int4_matmul_panel_amx do; bf16 out.
void packed_amx_pairs(const Linear& l, const Input& in, int64_t M, uint16_t* y, int64_t t0, int64_t t1) {
  const int64_t K = l.K, G = l.G;
  const auto* q = static_cast<const uint8_t*>(l.w.data_ptr());
  if (l.kind == kInt8) {
    const float* sp = l.s.data_ptr<float>();
    tq::amx_pairs<false>(in.xb, in.tail.data(), M, K, l.panels(), tq::AmxOut{y, true, l.N, M, G == K ? sp : nullptr},
                         [&](int64_t p0, int64_t p1, std::vector<uint16_t>& scratch) {
                           scratch.resize((p1 - p0) * 16 * K);
                           tq::dequant_int8_panels(reinterpret_cast<const int8_t*>(q), sp, K, G, p0, p1,
                                                   scratch.data());
                           return static_cast<const uint16_t*>(scratch.data());
                         },
                         t0, t1);
    return;
  }
  const auto* sp = reinterpret_cast<const uint16_t*>(l.s.data_ptr<at::Half>());
  const auto* zp = reinterpret_cast<const uint16_t*>(l.z.data_ptr<at::Half>());
  tq::amx_pairs<false>(in.xb, in.tail.data(), M, K, l.panels(), tq::AmxOut{y, true, l.N, M},
                       [&](int64_t p0, int64_t p1, std::vector<uint16_t>& scratch) {
                         scratch.resize((p1 - p0) * 16 * K);
                         tq::dequant_int4_panels(q, sp, zp, K, G, p0, p1, scratch.data());
                         return static_cast<const uint16_t*>(scratch.data());
                       },
                       t0, t1);
}
#endif

void matmul_part(const Linear& l, const Input& in, int64_t M, uint16_t* y, float* scratch, int tid, int nt) {
  // bf16 panels go in pairs (AMX's and vdpbf16ps's tiles take two panels)
  const int64_t panels = l.panels();
  int64_t t0, t1;
  share((panels + 1) / 2, tid, nt, t0, t1);
  if (t0 >= t1) return;
  const int64_t p0 = 2 * t0, p1 = std::min(panels, 2 * t1);
  const bool packed = l.kind != kBFloat16;
  const auto* w = packed ? nullptr : reinterpret_cast<const uint16_t*>(l.w.data_ptr<at::BFloat16>());
  switch (in.path) {
    case Bf16Path::kAmx:
#ifdef TANDEM_HAVE_AMX
      if (packed) packed_amx_pairs(l, in, M, y, t0, t1);
      else tq::amx_pairs<true>(in.xb, in.tail.data(), M, l.K, panels, tq::AmxOut{y, true, l.N, M},
                               [&](int64_t q0, int64_t, std::vector<uint16_t>&) { return w + q0 * 16 * l.K; }, t0, t1);
#endif
      return;
    case Bf16Path::kA8:
      packed_span(l, in, M, scratch, p0, p1);
      break;
    case Bf16Path::kDot:
#if defined(__AVX512F__) && defined(__AVX512BW__)
      tq::dense_bf16_pairs(in.xb, M, l.K, w, scratch, l.N, panels, t0, t1);
#endif
      break;
    case Bf16Path::kFma:
      tq::dense_fma_span<true>(in.xf.data(), M, l.K, w, scratch, l.N, p0, p1);
      break;
  }
  round_columns(scratch, y, M, l.N, p0 * 16, p1 * 16);
}

// Attention of rows' (sequence, KV head) pairs [i0, i1) when the attention module splits heads, else of
// rows [i0, i1): the attention module's own compiled function (see decode_step_plan). T: float or uint16_t
// (bf16 bits), which the attention module reads as c10::BFloat16.
template <typename T>
void attention_part(const Plan& p, const Layer& ly, const T* q, T* out, const int32_t* tables, int64_t table_stride,
                    const int64_t* lens, int64_t i0, int64_t i1) {
  using A = std::conditional_t<std::is_same_v<T, float>, float, c10::BFloat16>;
  const auto fn = reinterpret_cast<AttentionFn<A>>(p.attention);
  const int64_t kstride[3] = {ly.kc.stride(0), ly.kc.stride(1), ly.kc.stride(2)};
  const int64_t vstride[3] = {ly.vc.stride(0), ly.vc.stride(1), ly.vc.stride(2)};
  const auto* kc = static_cast<const A*>(ly.kc.data_ptr());
  const auto* vc = static_cast<const A*>(ly.vc.data_ptr());
  const auto* qa = reinterpret_cast<const A*>(q);
  auto* oa = reinterpret_cast<A*>(out);
  const int64_t block_size = ly.kc.size(1);
  const auto scale = static_cast<float>(p.scale);
  if (!p.splits_heads) {
    fn(qa, kc, vc, kstride, vstride, tables, table_stride, lens, oa, p.Hq, p.Hkv, p.D, block_size, scale, i0, i1, 0,
       p.Hkv);
    return;
  }
  // Items are (sequence, KV head): a sequence split between threads gets its share of heads, and the whole
  // sequences between go in one call, as the op-by-op kernel runs them (a sequence's blocks hold every head's
  // rows side by side, so one sweep prefetches them once, and the next sequence's first blocks are prefetched
  // during this one). One call per (sequence, head) prefetched each block once per head, never the next
  // sequence (with the prefetch into L1 and the cache on huge pages, session 31: 48 sequences of 384-512 tokens,
  // SmolLM2 bf16, 2 Xeon threads, the step's attention 33.3-36.8 -> 28.1-29.9 ms).
  int64_t i = i0;
  if (i % p.Hkv != 0) {  // the tail of a sequence begun by the thread before
    const int64_t s = i / p.Hkv, h1 = std::min(i1 - s * p.Hkv, p.Hkv);
    fn(qa, kc, vc, kstride, vstride, tables, table_stride, lens, oa, p.Hq, p.Hkv, p.D, block_size, scale, s, s + 1,
       i % p.Hkv, h1);
    i = s * p.Hkv + h1;
  }
  const int64_t s_begin = i / p.Hkv, s_end = i1 / p.Hkv;
  if (i < i1 && s_begin < s_end) {
    fn(qa, kc, vc, kstride, vstride, tables, table_stride, lens, oa, p.Hq, p.Hkv, p.D, block_size, scale, s_begin,
       s_end, 0, p.Hkv);
    i = s_end * p.Hkv;
  }
  if (i < i1) {  // the head of a sequence the next thread finishes
    fn(qa, kc, vc, kstride, vstride, tables, table_stride, lens, oa, p.Hq, p.Hkv, p.D, block_size, scale, i / p.Hkv,
       i / p.Hkv + 1, 0, i1 - i);
  }
}

Plan& plan_at(int64_t handle) {
  std::lock_guard<std::mutex> guard(plans_lock);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(plans.size()) && plans[handle], "no decode plan ", handle);
  return *plans[handle];
}

}  // namespace tstep

// Registers a model's layers for decode_step_run; returns the plan's handle. Per layer, ``tensors`` holds
// 14 entries (input norm, post-attention norm, then weights, scales, zeros of qkv, o, gate_up, down; unused
// ones empty), ``kinds`` 8 (weight kind 4 / 8 / 16 / 32 / 33 and group size of each projection), ``caches`` 2 (the
// layer's K and V cache, [blocks, block_size, H_kv, D] in the activation dtype, unit stride over D).
// ``dtype``: the activations', "float32" (kinds 4, 8, 32, 33) or "bfloat16" (kinds 4, 8, 16); ``amx_min_rows``,
// ``amx_quant_min_rows``: from how many rows bf16 panels, and int8 / int4 panels with bf16 activations, go
// through AMX tiles (the op-by-op kernels' thresholds, from Python).
// ``attention``: the address of the attention module's decode_rows for the dtype (``decode_rows_address``),
// ``splits_heads``: its ``decode_splits_heads(head_dim)``.
int64_t decode_step_plan(std::vector<torch::Tensor> tensors, std::vector<int64_t> kinds,
                         std::vector<torch::Tensor> caches, torch::Tensor final_norm, double eps, double scale,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
                         const std::string& dtype, int64_t amx_min_rows, int64_t amx_quant_min_rows,
                         int64_t attention, bool splits_heads) {
  using namespace tstep;
  const int64_t L = static_cast<int64_t>(caches.size()) / 2;
  TORCH_CHECK(L > 0 && static_cast<int64_t>(tensors.size()) == 14 * L && static_cast<int64_t>(kinds.size()) == 8 * L,
              "decode_step_plan: 14 tensors, 8 kinds and 2 caches per layer");
  TORCH_CHECK(attention != 0, "decode_step_plan: no attention function");
  TORCH_CHECK(dtype == "float32" || dtype == "bfloat16", "decode_step_plan: float32 or bfloat16, not ", dtype);
  auto plan = std::make_unique<Plan>();
  plan->bf16 = dtype == "bfloat16";
  plan->amx_min_rows = amx_min_rows;
  plan->amx_quant_min_rows = amx_quant_min_rows;
  const auto act = plan->bf16 ? at::kBFloat16 : at::kFloat;
  plan->attention = reinterpret_cast<void*>(attention);
  plan->splits_heads = splits_heads;
  plan->hidden = final_norm.numel();
  plan->Hq = num_heads;
  plan->Hkv = num_kv_heads;
  plan->D = head_dim;
  plan->inter = intermediate;
  plan->eps = static_cast<float>(eps);
  plan->scale = scale;
  TORCH_CHECK(final_norm.scalar_type() == act && final_norm.is_contiguous(), "final norm: contiguous ", dtype);
  plan->final_norm = final_norm;
  const int64_t H = plan->hidden, q = num_heads * head_dim, kv = num_kv_heads * head_dim;
  TORCH_CHECK(num_heads % num_kv_heads == 0, "decode_step_plan: heads must be a multiple of KV heads");
  const int64_t shapes[4][2] = {{q + 2 * kv, H}, {H, q}, {2 * intermediate, H}, {H, intermediate}};
  const char* names[4] = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
  for (int64_t i = 0; i < L; ++i) {
    Layer ly;
    const torch::Tensor* t = tensors.data() + 14 * i;
    const int64_t* k = kinds.data() + 8 * i;
    ly.norm1 = t[0];
    ly.norm2 = t[1];
    TORCH_CHECK(t[0].scalar_type() == act && t[1].scalar_type() == act && t[0].is_contiguous() &&
                    t[1].is_contiguous() && t[0].numel() == H && t[1].numel() == H, "layer norms: contiguous ", dtype);
    Linear* lin[4] = {&ly.qkv, &ly.o, &ly.gate_up, &ly.down};
    for (int j = 0; j < 4; ++j) {
      TORCH_CHECK(k[2 * j] != (plan->bf16 ? kFloat32 : kBFloat16) && !(plan->bf16 && k[2 * j] == kRowFloat32), names[j],
                  ": float weights of the activations' dtype");
      *lin[j] = make_linear(t[2 + 3 * j], t[3 + 3 * j], t[4 + 3 * j], k[2 * j], k[2 * j + 1], shapes[j][0],
                            shapes[j][1], names[j]);
    }
    ly.kc = caches[2 * i];
    ly.vc = caches[2 * i + 1];
    for (const auto& c : {ly.kc, ly.vc})
      TORCH_CHECK(c.scalar_type() == act && c.dim() == 4 && c.size(2) == num_kv_heads && c.size(3) == head_dim &&
                      c.stride(3) == 1, "caches: ", dtype, " [blocks, block_size, H_kv, D], unit stride over D");
    plan->layers.push_back(std::move(ly));
  }
  std::lock_guard<std::mutex> guard(plans_lock);
  plans.push_back(std::move(plan));
  return static_cast<int64_t>(plans.size()) - 1;
}

void decode_step_free(int64_t handle) {
  std::lock_guard<std::mutex> guard(tstep::plans_lock);
  if (handle >= 0 && handle < static_cast<int64_t>(tstep::plans.size())) tstep::plans[handle].reset();
}

namespace tstep {

// The layers for M rows in the activation storage C (tf::F32 or tf::BF16): see decode_step_run.
template <typename C, typename T = typename C::storage>
void run_layers(Plan& p, int64_t M, int64_t L, T* res, T* out, const int64_t* pos, const int64_t* slots,
                const T* cs, const int32_t* tables, int64_t table_stride, const int64_t* lens) {
  const int64_t H = p.hidden, D = p.D, q_size = p.Hq * D, kv_size = p.Hkv * D;
  // Activations: a norm's output, qkv, the attention's q (contiguous per row, as the attention kernel reads
  // it) and output, a projection's output, gate_up, SiLU * up; fp32 sums of a projection (bf16 panels).
  const int64_t width = q_size + 2 * kv_size;
  std::vector<T> h(M * H), qkv(M * width), qrows(M * q_size), attn(M * q_size), proj(M * H), gu(M * 2 * p.inter),
      act(M * p.inter);
  std::vector<float> scratch(p.bf16 ? M * std::max({width, 2 * p.inter, H}) : 0);
  Input in_qkv, in_o, in_gu, in_down;
  const Layer& first = p.layers[0];  // every layer's projections have the same shapes and kinds
  bind(p, first.qkv, h.data(), M, in_qkv);
  bind(p, first.o, attn.data(), M, in_o);
  bind(p, first.gate_up, h.data(), M, in_gu);
  bind(p, first.down, act.data(), M, in_down);
  const bool prep_qkv = needs_prepare(p, first.qkv, in_qkv, M), prep_o = needs_prepare(p, first.o, in_o, M),
             prep_gu = needs_prepare(p, first.gate_up, in_gu, M), prep_down = needs_prepare(p, first.down, in_down, M);
  const int64_t items = p.splits_heads ? M * p.Hkv : M;
  const int nt_req = std::max(1, at::get_num_threads());
  const bool profile = p.profile;
  double spent[3] = {0., 0., 0.};
  double last = profile ? omp_get_wtime() : 0.;
  // The elementwise parts (norms, rotary and the K/V write, SiLU): one thread for a few rows (a barrier
  // costs more than their work), split by rows over the threads from kSplitRows rows. A row's result does
  // not depend on who computes it.
  const bool split = M >= kSplitRows;
#pragma omp parallel num_threads(nt_req)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const auto mark = [&](int part) {  // thread 0, right after a barrier: the part just ended
      if (!profile || tid != 0) return;
      const double now = omp_get_wtime();
      spent[part] += now - last;
      last = now;
    };
    // rows(r0, n) on this thread's rows, then (once every row is done) the projection's per-layer input
    // work on one thread (``prep``: there is some); a barrier after.
    const auto elementwise = [&](const auto& rows, const Linear* l, Input* in, bool prep) {
      if (!split) {
#pragma omp single
        {
          rows(int64_t{0}, M);
          if (prep) prepare(p, *l, M, *in);
        }
        return;
      }
      int64_t r0, r1;
      share(M, tid, nt, r0, r1);
      if (r0 < r1) rows(r0, r1 - r0);
#pragma omp barrier
      if (prep) {
#pragma omp single
        prepare(p, *l, M, *in);
      }
    };
    enum { kMatmul = 0, kAttention = 1, kOther = 2 };
    for (int64_t l = 0; l < L; ++l) {
      const Layer& ly = p.layers[l];
      const T* norm1 = static_cast<const T*>(ly.norm1.data_ptr());
      const T* norm2 = static_cast<const T*>(ly.norm2.data_ptr());
      // layer 0: the embedding is the residual stream; after: residual += the last layer's output
      elementwise(
          [&](int64_t r0, int64_t n) {
            tf::add_rms_norm_impl<C>((l == 0 ? res : proj.data()) + r0 * H, res + r0 * H, norm1, h.data() + r0 * H,
                                     n, H, p.eps, l > 0);
          },
          &ly.qkv, &in_qkv, prep_qkv);
      mark(kOther);
      matmul_part(ly.qkv, in_qkv, M, qkv.data(), scratch.data(), tid, nt);
#pragma omp barrier
      mark(kMatmul);
      elementwise(
          [&](int64_t r0, int64_t n) {
            T* rows = qkv.data() + r0 * width;
            tf::rotary_impl<C>(rows, n, p.Hq, D, width, cs, pos + r0);
            tf::rotary_impl<C>(rows + q_size, n, p.Hkv, D, width, cs, pos + r0);
            T* kc = static_cast<T*>(ly.kc.data_ptr());
            T* vc = static_cast<T*>(ly.vc.data_ptr());
            const int64_t bs = ly.kc.size(1);
            for (int64_t i = r0; i < r0 + n; ++i) {
              const T* row = qkv.data() + i * width;
              std::memcpy(qrows.data() + i * q_size, row, q_size * sizeof(T));
              const int64_t block = slots[i] / bs, offset = slots[i] % bs;
              for (int64_t hk = 0; hk < p.Hkv; ++hk) {
                std::memcpy(kc + block * ly.kc.stride(0) + offset * ly.kc.stride(1) + hk * ly.kc.stride(2),
                            row + q_size + hk * D, D * sizeof(T));
                std::memcpy(vc + block * ly.vc.stride(0) + offset * ly.vc.stride(1) + hk * ly.vc.stride(2),
                            row + q_size + kv_size + hk * D, D * sizeof(T));
              }
            }
          },
          nullptr, nullptr, false);
      {
        mark(kOther);
        int64_t i0, i1;
        share(items, tid, nt, i0, i1);
        if (i0 < i1) attention_part<T>(p, ly, qrows.data(), attn.data(), tables, table_stride, lens, i0, i1);
      }
#pragma omp barrier
      mark(kAttention);
      if (prep_o) {
#pragma omp single
        prepare(p, ly.o, M, in_o);
      }
      mark(kOther);
      matmul_part(ly.o, in_o, M, proj.data(), scratch.data(), tid, nt);
#pragma omp barrier
      mark(kMatmul);
      elementwise(
          [&](int64_t r0, int64_t n) {
            tf::add_rms_norm_impl<C>(proj.data() + r0 * H, res + r0 * H, norm2, h.data() + r0 * H, n, H, p.eps, true);
          },
          &ly.gate_up, &in_gu, prep_gu);
      mark(kOther);
      matmul_part(ly.gate_up, in_gu, M, gu.data(), scratch.data(), tid, nt);
#pragma omp barrier
      mark(kMatmul);
      elementwise(
          [&](int64_t r0, int64_t n) {
            tf::silu_mul_impl<C>(gu.data() + r0 * 2 * p.inter, act.data() + r0 * p.inter, n, p.inter, 2 * p.inter);
          },
          &ly.down, &in_down, prep_down);
      mark(kOther);
      matmul_part(ly.down, in_down, M, proj.data(), scratch.data(), tid, nt);
#pragma omp barrier
      mark(kMatmul);
    }
  }
  if (profile) {
    std::lock_guard<std::mutex> guard(plans_lock);
    for (int i = 0; i < 3; ++i) p.seconds[i] += spent[i];
  }
  const T* final_norm = static_cast<const T*>(p.final_norm.data_ptr());
  if (L == 0) tf::add_rms_norm_impl<C>(res, res, final_norm, out, M, H, p.eps, false);
  else tf::add_rms_norm_impl<C>(proj.data(), res, final_norm, out, M, H, p.eps, true);
}

}  // namespace tstep

// x: [M, hidden] in the plan's dtype (the embedded tokens), M <= 16 decode rows, each a token attending to
// its sequence's cached prefix and itself: positions [M] int64, slot_mapping [M] int64 (where its K/V goes),
// block_tables [M, max_blocks] int32 (its sequence's), seq_lens [M] (the length it attends to, itself
// included; the rows of one sequence's chunk: consecutive lengths, every row's K/V written before any
// attention reads); cos_sin: the rotary table [>= max position + 1, D] in the plan's dtype.
// Returns the final norm of the hidden states after the first ``num_layers`` layers.
torch::Tensor decode_step_run(int64_t handle, torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin,
                              torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens,
                              int64_t num_layers) {
  using namespace tstep;
  Plan& p = plan_at(handle);
  const int64_t M = x.size(0), H = p.hidden, D = p.D;
  const int64_t L = std::min<int64_t>(num_layers, static_cast<int64_t>(p.layers.size()));
  const auto act = p.bf16 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == act && x.size(1) == H,
              "x: contiguous [M, hidden] of the plan's dtype");
  TORCH_CHECK(M >= 1 && M <= MAX_ROWS, "decode_step_run: 1 to ", MAX_ROWS, " rows, not ", M);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == M,
              "positions: contiguous int64 [M]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == M,
              "slot_mapping: contiguous int64 [M]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == M &&
                  block_tables.stride(1) == 1, "block_tables: int32 [M, max_blocks]");
  TORCH_CHECK(cos_sin.scalar_type() == act && cos_sin.is_contiguous() && cos_sin.size(1) == D,
              "cos_sin: contiguous [P, head_dim] of the plan's dtype");
  TORCH_CHECK((seq_lens.scalar_type() == at::kLong || seq_lens.scalar_type() == at::kInt) && seq_lens.is_contiguous() &&
                  seq_lens.numel() == M, "seq_lens: contiguous int32 or int64 [M]");
  std::vector<int64_t> lens(M);
  for (int64_t i = 0; i < M; ++i)
    lens[i] = seq_lens.scalar_type() == at::kLong ? seq_lens.data_ptr<int64_t>()[i] : seq_lens.data_ptr<int32_t>()[i];
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cos_sin.size(0), "position ", pos[i], " is beyond the rotary table");
    TORCH_CHECK(lens[i] >= 1 && (lens[i] - 1 + p.layers[0].kc.size(1)) / p.layers[0].kc.size(1) <= block_tables.size(1),
                "seq_lens: row ", i, " needs more blocks than its table holds");
    TORCH_CHECK(slots[i] >= 0 && slots[i] < p.layers[0].kc.size(0) * p.layers[0].kc.size(1), "slot ", slots[i],
                " is outside the cache");
  }
  torch::Tensor residual = x.clone();  // the residual stream
  torch::Tensor out = torch::empty_like(x);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  if (p.bf16) {
    run_layers<tf::BF16>(p, M, L, static_cast<uint16_t*>(residual.data_ptr()), static_cast<uint16_t*>(out.data_ptr()),
                         pos, slots, static_cast<const uint16_t*>(cos_sin.data_ptr()), tables, block_tables.stride(0),
                         lens.data());
  } else {
    run_layers<tf::F32>(p, M, L, residual.data_ptr<float>(), out.data_ptr<float>(), pos, slots,
                        cos_sin.data_ptr<float>(), tables, block_tables.stride(0), lens.data());
  }
  return out;
}

// Profiling of a plan's runs: on or off; ``decode_step_times`` returns [projections, attention, the rest]
// in seconds summed since the last call (the final norm after the layers is not in them), and resets them.
void decode_step_profile(int64_t handle, bool on) { tstep::plan_at(handle).profile = on; }

std::vector<double> decode_step_times(int64_t handle) {
  tstep::Plan& p = tstep::plan_at(handle);
  std::lock_guard<std::mutex> guard(tstep::plans_lock);
  std::vector<double> out(p.seconds, p.seconds + 3);
  for (double& s : p.seconds) s = 0.;
  return out;
}
