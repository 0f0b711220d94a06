// vdpbf16ps and vfmadd231ps on zmm registers, 12 independent chains, one thread: the core's peak (session 39).
//     gcc -O2 peak.c -o peak && ./peak
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define TWELVE(op)                                                                                        \
  op " %%zmm0,%%zmm0,%%zmm1\n" op " %%zmm0,%%zmm0,%%zmm2\n" op " %%zmm0,%%zmm0,%%zmm3\n" op               \
     " %%zmm0,%%zmm0,%%zmm4\n" op " %%zmm0,%%zmm0,%%zmm5\n" op " %%zmm0,%%zmm0,%%zmm6\n" op               \
     " %%zmm0,%%zmm0,%%zmm7\n" op " %%zmm0,%%zmm0,%%zmm8\n" op " %%zmm0,%%zmm0,%%zmm9\n" op               \
     " %%zmm0,%%zmm0,%%zmm10\n" op " %%zmm0,%%zmm0,%%zmm11\n" op " %%zmm0,%%zmm0,%%zmm12\n"

int main(void) {
  const long iterations = 100000000;
  long n = iterations;
  double t = now();
  __asm__ volatile("vpxord %%zmm0,%%zmm0,%%zmm0\n1:\n" TWELVE("vdpbf16ps") "dec %0\n jnz 1b\n"
                   : "+r"(n)::"xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
                     "xmm11", "xmm12");
  printf("%.1f GFLOP/s one thread, vdpbf16ps zmm (64 flop each)\n", iterations * 12 * 64.0 / (now() - t) / 1e9);
  n = iterations;
  t = now();
  __asm__ volatile("vpxord %%zmm0,%%zmm0,%%zmm0\n1:\n" TWELVE("vfmadd231ps") "dec %0\n jnz 1b\n"
                   : "+r"(n)::"xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
                     "xmm11", "xmm12");
  printf("%.1f GFLOP/s one thread, vfmadd231ps zmm (32 flop each)\n", iterations * 12 * 32.0 / (now() - t) / 1e9);
  return 0;
}
