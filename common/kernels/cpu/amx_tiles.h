// AMX's grant and tile configuration, and whether the CPU has AVX512-BF16 (the bf16 path where AMX is not granted),
// shared by the linears (cpu_amx.cpp, cpu_gemv.cpp, in the linears / fused ops / step module) and the prefill
// attention (cpu_prefill_attn.cpp, in the attention module): each module lists this header unwrapped before its
// kernel files (common/kernels/cpu/__init__.py), so both read one definition.
//
// Linux grants the tile state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM); ``tandem_amx::ready()``
// asks once and reports false where the CPU or the kernel lacks AMX. TANDEM_HAVE_AMX: the compiler and the
// build's flags can emit it at all.
#ifndef TANDEM_AMX_TILES_H
#define TANDEM_AMX_TILES_H

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace tandem_amx {
// vdpbf16ps on this CPU (decided once): builds for AVX-512 leave AVX512-BF16 to a run-time check.
inline bool bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
}  // namespace tandem_amx
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__linux__) && defined(__GNUC__) && \
    (__GNUC__ >= 11 || defined(__clang__))
#define TANDEM_HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace tandem_amx {

inline bool ready() {
  static const bool granted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;  // CPUID.(7,0):EDX AMX-TILE, AMX-BF16
    if (!tile || !bf16) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// ldtilecfg's 64-byte operand: palette 1, each tile's bytes per row and rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace tandem_amx
#endif

#endif  // TANDEM_AMX_TILES_H
