/* How many of the block kernel's vector instructions a core issues per cycle, alone and mixed: the
 * bound on a 32-row product (docs/benchmarks.md, "what bounds a 32-row product").
 *
 *     gcc -O2 -mavx2 bench/cpu_port_rates.c -o /tmp/cpu_port_rates && /tmp/cpu_port_rates
 *
 * Each loop issues independent instructions (no chain longer than one instruction per iteration
 * except 1-cycle adds), so a rate is a throughput. The clock is measured first by a chain of
 * dependent scalar adds (one a cycle). Run it alone on the machine (flock /tmp/forklm_bench.lock).
 */
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static double ghz;

#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
#define RATE(name, body, per)                                                            \
  {                                                                                      \
    const long n = 50000000;                                                             \
    const double t0 = now();                                                             \
    for (long i = 0; i < n; i++) __asm__ volatile(body ::: CLOBBER);                     \
    const double t = now() - t0;                                                         \
    printf("%-44s %.2f a cycle\n", name, (per) * (double)n / t / (ghz * 1e9));           \
  }

int main(void) {
  long x = 0;
  const long n = 200000000;
  double t0 = now();
  for (long i = 0; i < n; i++)
    __asm__ volatile("add $1,%0\n add $1,%0\n add $1,%0\n add $1,%0\n add $1,%0\n"
                     "add $1,%0\n add $1,%0\n add $1,%0\n add $1,%0\n add $1,%0" : "+r"(x));
  ghz = 10.0 * n / (now() - t0) / 1e9;
  printf("clock (dependent scalar adds): %.2f GHz\n", ghz);
  char buf[256] __attribute__((aligned(32))) = {0};
  (void)buf;
  RATE("vpaddw", "vpaddw %%ymm15,%%ymm0,%%ymm0\n vpaddw %%ymm15,%%ymm1,%%ymm1\n vpaddw %%ymm15,%%ymm2,%%ymm2\n"
       "vpaddw %%ymm15,%%ymm3,%%ymm3\n vpaddw %%ymm15,%%ymm4,%%ymm4\n vpaddw %%ymm15,%%ymm5,%%ymm5\n"
       "vpaddw %%ymm15,%%ymm6,%%ymm6\n vpaddw %%ymm15,%%ymm7,%%ymm7\n", 8)
  RATE("vpmaddubsw", "vpmaddubsw %%ymm15,%%ymm8,%%ymm0\n vpmaddubsw %%ymm15,%%ymm8,%%ymm1\n"
       "vpmaddubsw %%ymm15,%%ymm8,%%ymm2\n vpmaddubsw %%ymm15,%%ymm8,%%ymm3\n vpmaddubsw %%ymm15,%%ymm8,%%ymm4\n"
       "vpmaddubsw %%ymm15,%%ymm8,%%ymm5\n vpmaddubsw %%ymm15,%%ymm8,%%ymm6\n vpmaddubsw %%ymm15,%%ymm8,%%ymm7\n", 8)
  RATE("vpmaddubsw + vpmaddwd (1:1)", "vpmaddubsw %%ymm15,%%ymm8,%%ymm0\n vpmaddwd %%ymm15,%%ymm9,%%ymm1\n"
       "vpmaddubsw %%ymm15,%%ymm8,%%ymm2\n vpmaddwd %%ymm15,%%ymm9,%%ymm3\n vpmaddubsw %%ymm15,%%ymm8,%%ymm4\n"
       "vpmaddwd %%ymm15,%%ymm9,%%ymm5\n vpmaddubsw %%ymm15,%%ymm8,%%ymm6\n vpmaddwd %%ymm15,%%ymm9,%%ymm7\n", 8)
  RATE("vpmaddubsw + vpaddw (1:1)", "vpmaddubsw %%ymm15,%%ymm8,%%ymm0\n vpaddw %%ymm15,%%ymm1,%%ymm1\n"
       "vpmaddubsw %%ymm15,%%ymm8,%%ymm2\n vpaddw %%ymm15,%%ymm3,%%ymm3\n vpmaddubsw %%ymm15,%%ymm8,%%ymm4\n"
       "vpaddw %%ymm15,%%ymm5,%%ymm5\n vpmaddubsw %%ymm15,%%ymm8,%%ymm6\n vpaddw %%ymm15,%%ymm7,%%ymm7\n", 8)
  RATE("vpmaddubsw + vpaddw + vpand (1:1:1)", "vpand %%ymm15,%%ymm0,%%ymm0\n vpmaddubsw %%ymm15,%%ymm8,%%ymm1\n"
       "vpaddw %%ymm15,%%ymm9,%%ymm9\n vpand %%ymm15,%%ymm2,%%ymm2\n vpmaddubsw %%ymm15,%%ymm8,%%ymm3\n"
       "vpaddw %%ymm15,%%ymm10,%%ymm10\n vpand %%ymm15,%%ymm4,%%ymm4\n vpmaddubsw %%ymm15,%%ymm8,%%ymm5\n"
       "vpaddw %%ymm15,%%ymm11,%%ymm11\n vpand %%ymm15,%%ymm6,%%ymm6\n vpmaddubsw %%ymm15,%%ymm8,%%ymm7\n"
       "vpaddw %%ymm15,%%ymm12,%%ymm12\n", 12)
  RATE("vpbroadcastd from memory", "vpbroadcastd (%%rsp),%%ymm0\n vpbroadcastd 4(%%rsp),%%ymm1\n"
       "vpbroadcastd 8(%%rsp),%%ymm2\n vpbroadcastd 12(%%rsp),%%ymm3\n vpbroadcastd 16(%%rsp),%%ymm4\n"
       "vpbroadcastd 20(%%rsp),%%ymm5\n vpbroadcastd 24(%%rsp),%%ymm6\n vpbroadcastd 28(%%rsp),%%ymm7\n", 8)
  RATE("vpbroadcastd (memory) + vpmaddubsw + vpaddw", "vpbroadcastd (%%rsp),%%ymm0\n vpmaddubsw %%ymm15,%%ymm8,%%ymm1\n"
       "vpaddw %%ymm15,%%ymm9,%%ymm9\n vpbroadcastd 4(%%rsp),%%ymm2\n vpmaddubsw %%ymm15,%%ymm8,%%ymm3\n"
       "vpaddw %%ymm15,%%ymm10,%%ymm10\n vpbroadcastd 8(%%rsp),%%ymm4\n vpmaddubsw %%ymm15,%%ymm8,%%ymm5\n"
       "vpaddw %%ymm15,%%ymm11,%%ymm11\n vpbroadcastd 12(%%rsp),%%ymm6\n vpmaddubsw %%ymm15,%%ymm8,%%ymm7\n"
       "vpaddw %%ymm15,%%ymm12,%%ymm12\n", 12)
  RATE("vpsrlw", "vpsrlw $4,%%ymm15,%%ymm0\n vpsrlw $4,%%ymm15,%%ymm1\n vpsrlw $4,%%ymm15,%%ymm2\n"
       "vpsrlw $4,%%ymm15,%%ymm3\n vpsrlw $4,%%ymm15,%%ymm4\n vpsrlw $4,%%ymm15,%%ymm5\n"
       "vpsrlw $4,%%ymm15,%%ymm6\n vpsrlw $4,%%ymm15,%%ymm7\n", 8)
  return 0;
}
