// Which build of Kipp's CPU kernels this CPU runs (kipp/cuda/cpu/matmul.py's ISAS): compiled for
// the baseline instruction set, so it loads anywhere, and asks the CPU itself.
extern "C" int KippCpuIsa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni")) {
    return 2;  // avx512_vnni
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return 1;  // avx2
  }
#endif
  return 0;  // portable
}
