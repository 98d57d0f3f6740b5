// What Kipp's CPU kernels for the JAX backend share (matmul.cc, attention.cc,
// stored_matmul.cc): 8-float vectors with an explicit fused multiply-add, and a parallel loop
// over XLA's intra-op pool.
#ifndef KIPP_CUDA_CPU_KERNELS_H_
#define KIPP_CUDA_CPU_KERNELS_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#if defined(__FMA__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace kipp {

namespace ffi = xla::ffi;

typedef float v8 __attribute__((vector_size(32)));

inline v8 Load(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

inline v8 Broadcast(float v) { return v8{v, v, v, v, v, v, v, v}; }

// a * b + c with one rounding, always: the compiler's own contraction of `c += a * b` differs
// between code shapes, and a result must round the same way in every one.
inline v8 Fma(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return reinterpret_cast<v8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a),
                                              reinterpret_cast<__m256>(b),
                                              reinterpret_cast<__m256>(c)));
#elif defined(__aarch64__)
  float32x4_t r[2];
  for (int h = 0; h < 2; ++h) {
    float32x4_t av, bv, cv;
    std::memcpy(&av, reinterpret_cast<const float*>(&a) + 4 * h, 16);
    std::memcpy(&bv, reinterpret_cast<const float*>(&b) + 4 * h, 16);
    std::memcpy(&cv, reinterpret_cast<const float*>(&c) + 4 * h, 16);
    r[h] = vfmaq_f32(cv, av, bv);
  }
  v8 out;
  std::memcpy(&out, r, sizeof out);
  return out;
#else
  v8 out;
  for (int i = 0; i < 8; ++i) out[i] = std::fma(a[i], b[i], c[i]);
  return out;
#endif
}

// Runs unit(u) for every u in [0, units), in chunks of `chunk` units claimed from a shared
// counter by the calling thread and by up to pool.num_threads() - 1 helpers scheduled on XLA's
// intra-op pool. Returns when every unit has run: the caller waits only for units other
// threads have already claimed (late helpers find nothing left and return).
inline void ParallelFor(ffi::ThreadPool& pool, int64_t units, int64_t chunk,
                        std::function<void(int64_t)> unit) {
  struct Job {
    std::function<void(int64_t)> unit;
    int64_t units, chunk;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};

    void Work() {
      for (;;) {
        const int64_t begin = next.fetch_add(chunk);
        if (begin >= units) return;
        const int64_t end = std::min(units, begin + chunk);
        for (int64_t u = begin; u < end; ++u) unit(u);
        done.fetch_add(end - begin, std::memory_order_release);
      }
    }
  };
  if (units <= 0) return;
  auto job = std::make_shared<Job>();
  job->unit = std::move(unit);
  job->units = units;
  job->chunk = std::max<int64_t>(1, chunk);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min(threads, (units + job->chunk - 1) / job->chunk) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  while (job->done.load(std::memory_order_acquire) < units) std::this_thread::yield();
}

}  // namespace kipp

#endif  // KIPP_CUDA_CPU_KERNELS_H_
