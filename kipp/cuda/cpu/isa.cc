// Which build of Kipp's CPU kernels this CPU runs (kipp/cuda/cpu/matmul.py's ISAS): compiled for
// the baseline instruction set, so it loads anywhere, and asks the CPU itself.
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// AMX tiles with BF16 and AVX-512 BF16 (CPUID leaf 7), and the OS granting this process the
// tile state (Linux: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA; granted, it holds for the
// process, so the kernels then run their tiles without asking again).
static bool Amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tiles = (d >> 24 & 1) && (d >> 22 & 1);  // AMX-TILE, AMX-BF16
  if (!tiles || !__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a >> 5 & 1)) return false;
#if defined(__linux__)
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  return false;
#endif
}
#endif

extern "C" int KippCpuIsa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni")) {
    return Amx() ? 3 : 2;  // amx, avx512_vnni
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return 1;  // avx2
  }
#endif
  return 0;  // portable
}

// Whether the CPU runs AVX-512 BF16 dot products (vdpbf16ps): the BF16 dot of the AVX-512 builds.
extern "C" int KippCpuAvx512Bf16() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") ? 1 : 0;
#else
  return 0;
#endif
}
