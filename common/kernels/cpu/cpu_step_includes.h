// The headers of every kernel file common/kernels/cpu/cpu_step.cpp's module wraps in a namespace
// (common/model/decode_step.py): included here first, unwrapped, so the files' own includes are no-ops.
// torch: common/kernels/cpu/kernel_api.h, which common/kernels/build.py puts first
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__linux__) && defined(__GNUC__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
