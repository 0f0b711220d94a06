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
// Weights: fp32 panels (common/model/gemv.py's PanelLinear) or int8 / int4 panels with int8-rounded
// activations (common/quant/cpu_linear.py's tandem_a8 layers); activations fp32 (the dtype `--dtype auto`
// chooses where bf16 is slow: AVX2); up to MAX_ROWS rows, each one decode token of its own sequence.

namespace tstep {

constexpr int64_t MAX_ROWS = 16;
enum Kind : int64_t { kInt4 = 4, kInt8 = 8, kFloat32 = 32 };

struct Linear {
  int64_t kind = 0, N = 0, K = 0, G = 0;
  torch::Tensor w, s, z;  // fp32 panels [N/16, K, 16] | int q panels, scales, zeros (int4)
  int64_t panels() const { return N / 16; }
};

struct Layer {
  torch::Tensor norm1, norm2, kc, vc;
  Linear qkv, o, gate_up, down;
};

// common/attention/cpu_decode.cpp's decode_rows_f32, in the attention module: attention is that module's
// compiled code (its own flags: -ffast-math's vector exp), so the rows equal paged_decode's.
using AttentionFn = void (*)(const float*, const float*, const float*, const int64_t*, const int64_t*,
                             const int32_t*, int64_t, const int64_t*, float*, int64_t, int64_t, int64_t, int64_t,
                             float, int64_t, int64_t, int64_t, int64_t);

struct Plan {
  std::vector<Layer> layers;
  AttentionFn attention = nullptr;
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
  TORCH_CHECK(N % 16 == 0, name, ": out_features must be a multiple of 16");
  TORCH_CHECK(w.is_contiguous() && w.dim() == (kind == kFloat32 ? 3 : 4) && w.size(0) == N / 16, name,
              ": weights must be contiguous 16-row panels");
  if (kind == kFloat32) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.size(1) == K && w.size(2) == 16, name, ": fp32 panels [N/16, K, 16]");
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

// One projection's input, prepared once by one thread (int8 rounding for the packed kinds).
struct Input {
  const float* x = nullptr;
  tq::QuantX xq;
};

void prepare(const Linear& l, const float* x, int64_t M, Input& in) {
  in.x = x;
  if (l.kind != kFloat32) tq::quantize_x(x, M, l.K, l.G, in.xq);
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

// The same for fp32 panels: dense_matmul_panel's fp32 loop.
void dense_span(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) dense_panel_tile_fma<4, false>(x + m * K, K, w, y + m * N, N, p);
    for (; m < M; ++m) dense_panel_tile_fma<1, false>(x + m * K, K, w, y + m * N, N, p);
  }
}

}  // namespace tq

namespace tstep {

// This thread's share [begin, end) of n items.
inline void share(int64_t n, int tid, int nt, int64_t& begin, int64_t& end) {
  begin = n * tid / nt;
  end = n * (tid + 1) / nt;
}

void matmul_part(const Linear& l, const Input& in, int64_t M, float* y, int tid, int nt) {
  int64_t p0, p1;
  share(l.panels(), tid, nt, p0, p1);
  if (p0 >= p1) return;
  if (l.kind == kFloat32) {
    tq::dense_span(in.x, M, l.K, l.w.data_ptr<float>(), y, l.N, p0, p1);
    return;
  }
  const bool int4 = l.kind == kInt4;
  const tq::PanelArgs args{in.xq, l.K, l.G, l.N, static_cast<const uint8_t*>(l.w.data_ptr()),
                           int4 ? nullptr : l.s.data_ptr<float>(),
                           int4 ? reinterpret_cast<const uint16_t*>(l.s.data_ptr<at::Half>()) : nullptr,
                           int4 ? reinterpret_cast<const uint16_t*>(l.z.data_ptr<at::Half>()) : nullptr,
                           !int4 && l.G == l.K, y};
  if (int4) tq::panel_span<true>(args, M, p0, p1);
  else tq::panel_span<false>(args, M, p0, p1);
}

// Attention of rows' (sequence, KV head) pairs [i0, i1) when the attention module splits heads, else of
// rows [i0, i1): the attention module's own compiled function (see decode_step_plan).
void attention_part(const Plan& p, const Layer& ly, const float* q, float* out, const int32_t* tables,
                    int64_t table_stride, const int64_t* lens, int64_t i0, int64_t i1) {
  const int64_t kstride[3] = {ly.kc.stride(0), ly.kc.stride(1), ly.kc.stride(2)};
  const int64_t vstride[3] = {ly.vc.stride(0), ly.vc.stride(1), ly.vc.stride(2)};
  const float* kc = ly.kc.data_ptr<float>();
  const float* vc = ly.vc.data_ptr<float>();
  const int64_t block_size = ly.kc.size(1);
  const auto scale = static_cast<float>(p.scale);
  if (!p.splits_heads) {
    p.attention(q, kc, vc, kstride, vstride, tables, table_stride, lens, out, p.Hq, p.Hkv, p.D, block_size, scale, i0,
                i1, 0, p.Hkv);
    return;
  }
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t s = i / p.Hkv, h = i % p.Hkv;
    p.attention(q, kc, vc, kstride, vstride, tables, table_stride, lens, out, p.Hq, p.Hkv, p.D, block_size, scale, s,
                s + 1, h, h + 1);
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
// ones empty), ``kinds`` 8 (weight kind 4 / 8 / 32 and group size of each projection), ``caches`` 2 (the
// layer's K and V cache, fp32 [blocks, block_size, H_kv, D], unit stride over D).
// ``attention``: the address of the attention module's decode_rows_f32 (``decode_rows_f32_address()``),
// ``splits_heads``: its ``decode_splits_heads(head_dim)``.
int64_t decode_step_plan(std::vector<torch::Tensor> tensors, std::vector<int64_t> kinds,
                         std::vector<torch::Tensor> caches, torch::Tensor final_norm, double eps, double scale,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
                         int64_t attention, bool splits_heads) {
  using namespace tstep;
  const int64_t L = static_cast<int64_t>(caches.size()) / 2;
  TORCH_CHECK(L > 0 && static_cast<int64_t>(tensors.size()) == 14 * L && static_cast<int64_t>(kinds.size()) == 8 * L,
              "decode_step_plan: 14 tensors, 8 kinds and 2 caches per layer");
  TORCH_CHECK(attention != 0, "decode_step_plan: no attention function");
  auto plan = std::make_unique<Plan>();
  plan->attention = reinterpret_cast<AttentionFn>(attention);
  plan->splits_heads = splits_heads;
  plan->hidden = final_norm.numel();
  plan->Hq = num_heads;
  plan->Hkv = num_kv_heads;
  plan->D = head_dim;
  plan->inter = intermediate;
  plan->eps = static_cast<float>(eps);
  plan->scale = scale;
  TORCH_CHECK(final_norm.scalar_type() == at::kFloat && final_norm.is_contiguous(), "final norm: contiguous fp32");
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
    TORCH_CHECK(t[0].scalar_type() == at::kFloat && t[1].scalar_type() == at::kFloat && t[0].is_contiguous() &&
                    t[1].is_contiguous() && t[0].numel() == H && t[1].numel() == H, "layer norms: contiguous fp32");
    Linear* lin[4] = {&ly.qkv, &ly.o, &ly.gate_up, &ly.down};
    for (int j = 0; j < 4; ++j)
      *lin[j] = make_linear(t[2 + 3 * j], t[3 + 3 * j], t[4 + 3 * j], k[2 * j], k[2 * j + 1], shapes[j][0],
                            shapes[j][1], names[j]);
    ly.kc = caches[2 * i];
    ly.vc = caches[2 * i + 1];
    for (const auto& c : {ly.kc, ly.vc})
      TORCH_CHECK(c.scalar_type() == at::kFloat && c.dim() == 4 && c.size(2) == num_kv_heads && c.size(3) == head_dim &&
                      c.stride(3) == 1, "caches: fp32 [blocks, block_size, H_kv, D], unit stride over D");
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

// x: [M, hidden] fp32 (the embedded tokens), M <= 16 decode rows, each a token attending to its sequence's
// cached prefix and itself: positions [M] int64, slot_mapping [M] int64 (where its K/V goes), block_tables
// [M, max_blocks] int32 (its sequence's), seq_lens [M] (the length it attends to, itself included; the
// rows of one sequence's chunk: consecutive lengths, every row's K/V written before any attention reads);
// cos_sin: the rotary table [>= max position + 1, D] fp32.
// Returns the final norm of the hidden states after the first ``num_layers`` layers.
torch::Tensor decode_step_run(int64_t handle, torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin,
                              torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens,
                              int64_t num_layers) {
  using namespace tstep;
  Plan& p = plan_at(handle);
  const int64_t M = x.size(0), H = p.hidden, D = p.D, q_size = p.Hq * D, kv_size = p.Hkv * D;
  const int64_t L = std::min<int64_t>(num_layers, static_cast<int64_t>(p.layers.size()));
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == H,
              "x: contiguous fp32 [M, hidden]");
  TORCH_CHECK(M >= 1 && M <= MAX_ROWS, "decode_step_run: 1 to ", MAX_ROWS, " rows, not ", M);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == M,
              "positions: contiguous int64 [M]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == M,
              "slot_mapping: contiguous int64 [M]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == M &&
                  block_tables.stride(1) == 1, "block_tables: int32 [M, max_blocks]");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.size(1) == D,
              "cos_sin: contiguous fp32 [P, head_dim]");
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
  // Activations, fp32 rows: the residual stream, a norm's output, qkv, the attention output (q contiguous
  // per row, as the attention kernel reads it), a projection's output, gate_up, SiLU * up.
  torch::Tensor residual = x.clone();
  torch::Tensor out = torch::empty_like(x);
  std::vector<float> h(M * H), qkv(M * (q_size + 2 * kv_size)), qrows(M * q_size), attn(M * q_size), proj(M * H),
      gu(M * 2 * p.inter), act(M * p.inter);
  Input in_qkv, in_o, in_gu, in_down;
  float* res = residual.data_ptr<float>();
  const float* cs = cos_sin.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0), width = q_size + 2 * kv_size;
  const int64_t items = p.splits_heads ? M * p.Hkv : M;
  const int nt_req = std::max(1, at::get_num_threads());
  const bool profile = p.profile;
  double spent[3] = {0., 0., 0.};
  double last = profile ? omp_get_wtime() : 0.;
#pragma omp parallel num_threads(nt_req)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const auto mark = [&](int part) {  // thread 0, right after a barrier: the part just ended
      if (!profile || tid != 0) return;
      const double now = omp_get_wtime();
      spent[part] += now - last;
      last = now;
    };
    enum { kMatmul = 0, kAttention = 1, kOther = 2 };
    for (int64_t l = 0; l < L; ++l) {
      const Layer& ly = p.layers[l];
#pragma omp single
      {
        // layer 0: the embedding is the residual stream; after: residual += the last layer's output
        tf::add_rms_norm_impl<tf::F32>(l == 0 ? res : proj.data(), res, ly.norm1.data_ptr<float>(), h.data(), M, H,
                                       p.eps, l > 0);
        prepare(ly.qkv, h.data(), M, in_qkv);
      }
      mark(kOther);
      matmul_part(ly.qkv, in_qkv, M, qkv.data(), tid, nt);
#pragma omp barrier
      mark(kMatmul);
#pragma omp single
      {
        tf::rotary_impl<tf::F32>(qkv.data(), M, p.Hq, D, width, cs, pos);
        tf::rotary_impl<tf::F32>(qkv.data() + q_size, M, p.Hkv, D, width, cs, pos);
        float* kc = ly.kc.data_ptr<float>();
        float* vc = ly.vc.data_ptr<float>();
        const int64_t bs = ly.kc.size(1);
        for (int64_t i = 0; i < M; ++i) {
          const float* row = qkv.data() + i * width;
          std::memcpy(qrows.data() + i * q_size, row, q_size * sizeof(float));
          const int64_t block = slots[i] / bs, offset = slots[i] % bs;
          for (int64_t hk = 0; hk < p.Hkv; ++hk) {
            std::memcpy(kc + block * ly.kc.stride(0) + offset * ly.kc.stride(1) + hk * ly.kc.stride(2),
                        row + q_size + hk * D, D * sizeof(float));
            std::memcpy(vc + block * ly.vc.stride(0) + offset * ly.vc.stride(1) + hk * ly.vc.stride(2),
                        row + q_size + kv_size + hk * D, D * sizeof(float));
          }
        }
      }
      {
        mark(kOther);
        int64_t i0, i1;
        share(items, tid, nt, i0, i1);
        if (i0 < i1) attention_part(p, ly, qrows.data(), attn.data(), tables, table_stride, lens.data(), i0, i1);
      }
#pragma omp barrier
      mark(kAttention);
#pragma omp single
      prepare(ly.o, attn.data(), M, in_o);
      mark(kOther);
      matmul_part(ly.o, in_o, M, proj.data(), tid, nt);
#pragma omp barrier
      mark(kMatmul);
#pragma omp single
      {
        tf::add_rms_norm_impl<tf::F32>(proj.data(), res, ly.norm2.data_ptr<float>(), h.data(), M, H, p.eps, true);
        prepare(ly.gate_up, h.data(), M, in_gu);
      }
      mark(kOther);
      matmul_part(ly.gate_up, in_gu, M, gu.data(), tid, nt);
#pragma omp barrier
      mark(kMatmul);
#pragma omp single
      {
        tf::silu_mul_impl<tf::F32>(gu.data(), act.data(), M, p.inter, 2 * p.inter);
        prepare(ly.down, act.data(), M, in_down);
      }
      mark(kOther);
      matmul_part(ly.down, in_down, M, proj.data(), tid, nt);
#pragma omp barrier
      mark(kMatmul);
    }
  }
  if (profile) {
    std::lock_guard<std::mutex> guard(plans_lock);
    for (int i = 0; i < 3; ++i) p.seconds[i] += spent[i];
  }
  if (L == 0) {
    tf::add_rms_norm_impl<tf::F32>(res, res, p.final_norm.data_ptr<float>(), out.data_ptr<float>(), M, H, p.eps, false);
    return out;
  }
  tf::add_rms_norm_impl<tf::F32>(proj.data(), res, p.final_norm.data_ptr<float>(), out.data_ptr<float>(), M, H, p.eps,
                                 true);
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
