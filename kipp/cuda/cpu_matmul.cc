// Kipp's CPU matmul for the JAX backend: y[M, N] = x[M, K] @ W^T, float32, an XLA FFI handler.
//
// W arrives packed in panels of 8 output columns, w[N / 8][K][8] (kipp/cuda/cpu_matmul.py packs
// it once at load), so the kernel streams the weights front to back. A tile of MR rows and NP
// panels keeps MR x NP eight-wide accumulators in registers (at most 12): every weight vector
// loaded from memory serves all of the tile's rows, which is what lets 8 rows cost little more
// than one (XLA's library dots repack the weights on every call). Rounds of up to 8 rows are one
// tile per panel; more rows go panel by panel in groups of at most 8, so each panel comes from
// memory once and from cache for the other groups. Each output y[m][n] is one fused
// multiply-add chain over k = 0, 1, ..., K - 1 whatever the tile shape, the row count or the
// thread split, so a row's result is bitwise the same alone or batched.
//
// Work is split over XLA's intra-op thread pool in units of kUnit panels; the calling thread
// takes units too and then waits only for units other threads have already claimed.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__FMA__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 8;     // output columns per panel: one 8-wide vector
constexpr int64_t kUnit = 8;      // panels per work unit
constexpr int kMaxRows = 8;       // rows per tile
constexpr int64_t kPrefetch = 64;  // k steps ahead (2 KiB per panel stream)

typedef float v8 __attribute__((vector_size(32)));

inline v8 Load(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

inline v8 Broadcast(float v) { return v8{v, v, v, v, v, v, v, v}; }

// a * b + c with one rounding, always: the compiler's own contraction of `c += a * b` differs
// between tile shapes, and a row must round the same way in every tile.
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

// MR rows of x [MR][K] against NP consecutive panels: y[r][p * 8 + j].
template <int MR, int NP>
void Tile(const float* x, int64_t k_size, const float* w, float* y, int64_t ldy) {
  v8 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = v8{};
  const int64_t stride = k_size * kPanel;
  for (int64_t k = 0; k < k_size; ++k) {
    v8 wv[NP];
    for (int p = 0; p < NP; ++p) {
      const float* at = w + p * stride + k * kPanel;
      if ((k & 1) == 0) __builtin_prefetch(at + kPrefetch * kPanel);  // one per 64-byte line
      wv[p] = Load(at);
    }
    for (int r = 0; r < MR; ++r) {
      const v8 xv = Broadcast(x[r * k_size + k]);
      for (int p = 0; p < NP; ++p) acc[r][p] = Fma(xv, wv[p], acc[r][p]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) Store(y + r * ldy + p * kPanel, acc[r][p]);
}

// MR rows against `panels` panels, NP at a time (as many as the 12 accumulators allow).
template <int MR, int NP>
void Rows(const float* x, int64_t k_size, const float* w, int64_t panels, float* y,
          int64_t ldy) {
  const int64_t stride = k_size * kPanel;
  int64_t p = 0;
  for (; p + NP <= panels; p += NP) Tile<MR, NP>(x, k_size, w + p * stride, y + p * kPanel, ldy);
  for (; p < panels; ++p) Tile<MR, 1>(x, k_size, w + p * stride, y + p * kPanel, ldy);
}

using RowsFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);
constexpr RowsFn kRows[kMaxRows + 1] = {nullptr,       Rows<1, 8>, Rows<2, 4>,
                                         Rows<3, 4>,    Rows<4, 3>, Rows<5, 2>,
                                         Rows<6, 2>,    Rows<7, 1>, Rows<8, 1>};

constexpr int kWideRows = 6;  // rows per tile past kMaxRows: 6 x 2 panels = 12 accumulators
using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t);
constexpr TileFn kPairTile[kWideRows + 1] = {nullptr,    Tile<1, 2>, Tile<2, 2>, Tile<3, 2>,
                                             Tile<4, 2>, Tile<5, 2>, Tile<6, 2>};
constexpr TileFn kSingleTile[kWideRows + 1] = {nullptr,    Tile<1, 1>, Tile<2, 1>, Tile<3, 1>,
                                               Tile<4, 1>, Tile<5, 1>, Tile<6, 1>};

struct Job {
  const float* x;
  const float* w;
  float* y;
  int64_t m, k, n, panels, units, chunk;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // One work unit: kUnit panels (fewer at the end) for every row. Up to kMaxRows rows are one
  // tile per panel group; more rows (prefill) go in 6-row x 2-panel tiles, panel pair by panel
  // pair, so a pair is read from memory once and from cache for the other row groups.
  void Unit(int64_t u) const {
    const int64_t first = u * kUnit;
    const int64_t count = std::min(kUnit, panels - first);
    const float* wp = w + first * k * kPanel;
    float* yp = y + first * kPanel;
    if (m <= kMaxRows) {
      kRows[m](x, k, wp, count, yp, n);
      return;
    }
    for (int64_t p = 0; p < count; p += 2) {
      const bool pair = p + 1 < count;
      for (int64_t r = 0; r < m; r += kWideRows) {
        const int64_t rows = std::min<int64_t>(kWideRows, m - r);
        (pair ? kPairTile : kSingleTile)[rows](x + r * k, k, wp + p * k * kPanel,
                                               yp + r * n + p * kPanel, n);
      }
    }
  }

  // Claim chunks of units until none are left.
  void Work() {
    for (;;) {
      const int64_t begin = next.fetch_add(chunk);
      if (begin >= units) return;
      const int64_t end = std::min(units, begin + chunk);
      for (int64_t u = begin; u < end; ++u) Unit(u);
      done.fetch_add(end - begin, std::memory_order_release);
    }
  }
};

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel ||
      wd[1] != xd[1] || yd[0] != xd[0] || yd[1] != wd[0] * kPanel) {
    return ffi::Error::InvalidArgument(
        "kipp_cpu_matmul: expected x [M, K], w [N/8, K, 8], y [M, N] float32");
  }
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->m = xd[0];
  job->k = xd[1];
  job->n = yd[1];
  job->panels = wd[0];
  job->units = (job->panels + kUnit - 1) / kUnit;
  if (job->m == 0 || job->units == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  job->chunk = std::max<int64_t>(1, job->units / (threads * 8));
  const int64_t helpers = std::min(threads, (job->units + job->chunk - 1) / job->chunk) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  // Late helpers find no unit left and return; wait only for units claimed and running.
  while (job->done.load(std::memory_order_acquire) < job->units) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KippCpuMatmulF32, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
