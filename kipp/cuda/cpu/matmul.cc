// Kipp's CPU matmul for the JAX backend: y[M, N] = x[M, K] @ W^T, float32, an XLA FFI handler.
//
// W arrives packed in panels of 8 output columns, w[N / 8][K][8] (kipp/cuda/cpu/matmul.py packs
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
#include "kernels.h"

namespace {

using kipp::Broadcast;
using kipp::Fma;
using kipp::Load;
using kipp::Store;
using kipp::v8;
namespace ffi = xla::ffi;

constexpr int64_t kPanel = 8;     // output columns per panel: one 8-wide vector
constexpr int64_t kUnit = 8;      // panels per work unit
constexpr int kMaxRows = 8;       // rows per tile
constexpr int64_t kPrefetch = 64;  // k steps ahead (2 KiB per panel stream)

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

// One work unit: kUnit panels (fewer at the end) for every row. Up to kMaxRows rows are one
// tile per panel group; more rows (prefill) go in 6-row x 2-panel tiles, panel pair by panel
// pair, so a pair is read from memory once and from cache for the other row groups.
void Unit(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n,
          int64_t panels, int64_t u) {
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

// w holds the panels of one or more layers, [L, N / 8, K, 8]; `layer` picks one (the scanned
// step passes the whole stack and its loop index, so no slice of it is ever copied).
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || yd.size() != 2 || wd[3] != kPanel ||
      wd[2] != xd[1] || yd[0] != xd[0] || yd[1] != wd[1] * kPanel ||
      layer.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "kipp_cpu_matmul: expected x [M, K], w [L, N/8, K, 8], y [M, N] float32, layer [1] "
        "int32");
  }
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= wd[0]) {
    return ffi::Error::InvalidArgument("kipp_cpu_matmul: layer out of range");
  }
  const float* xp = x.typed_data();
  const float* wp = w.typed_data() + index * wd[1] * wd[2] * kPanel;
  float* yp = y->typed_data();
  const int64_t m = xd[0], k = xd[1], n = yd[1], panels = wd[1];
  const int64_t units = (panels + kUnit - 1) / kUnit;
  if (m == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  kipp::ParallelFor(pool, units, units / (threads * 8), [=](int64_t u) {
    Unit(xp, wp, yp, m, k, n, panels, u);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KippCpuMatmulF32, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
