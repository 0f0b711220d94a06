// ``write_kv`` scatters new tokens' K/V into their cache slots: one call per layer instead of the index
// arithmetic and two advanced-indexing writes of the PyTorch path (eight dispatches). Compiled after
// cpu_decode.cpp, in the same module (common/kernels/cpu/__init__.py), and after cpu_fused.cpp into the
// fused ops' module (common/model/fused_ops.py), whose rotary_write_kv_ calls it.

// key, value: [T, H_kv, D] (any strides over tokens and heads, unit over D), the caches' dtype;
// slot_mapping: [T] int64, slot = block * block_size + offset.
void write_kv(torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor key, torch::Tensor value,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4, "caches must be [blocks, block_size, H_kv, D]");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(0) == slot_mapping.size(0) &&
                  value.sizes() == key.sizes(), "key, value: [T, H_kv, D], one slot each");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type() &&
                  key_cache.scalar_type() == value_cache.scalar_type(), "write_kv: K/V and caches share a dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "write_kv: unit stride over D");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(), "slot_mapping: int64");
  const int64_t T = key.size(0), Hkv = key.size(1), D = key.size(2);
  const int64_t block_size = key_cache.size(1), num_blocks = key_cache.size(0);
  TORCH_CHECK(key_cache.size(2) == Hkv && key_cache.size(3) == D, "write_kv: heads or head_dim do not match");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t elem = key.element_size();
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    TORCH_CHECK(slots[t] >= 0 && block < num_blocks, "write_kv: slot ", slots[t], " is outside the cache");
    for (int64_t h = 0; h < Hkv; ++h) {
      std::memcpy(kc + (block * key_cache.stride(0) + offset * key_cache.stride(1) + h * key_cache.stride(2)) * elem,
                  kp + (t * key.stride(0) + h * key.stride(1)) * elem, D * elem);
      std::memcpy(vc + (block * value_cache.stride(0) + offset * value_cache.stride(1) + h * value_cache.stride(2)) * elem,
                  vp + (t * value.stride(0) + h * value.stride(1)) * elem, D * elem);
    }
  }
}
