// The AMX arm of Kipp's stored CPU matmul for BF16 weights: stored_matmul.cc includes it in the
// build for CPUs with AMX tiles (kipp/cuda/cpu/matmul.py's Isa.AMX), where a BF16 weight's dot
// runs on the tile unit (TDPBF16PS: 16 x 16 outputs of 32 products in one instruction) instead
// of AVX-512 FMAs, about 16 times the multiply rate per core.
//
// Exact operands: a tile multiplies bf16 by bf16 into float32, so each float32 x value is split
// into three bf16 parts, hi + mid + lo == x exactly (hi: x's top 16 bits; mid: the same of
// x - hi; lo: the rest, at most 8 significant bits), and the three parts' dots accumulate into
// one float32 sum; every product of a BF16 weight and a part is exact in float32. The only
// error is the tile unit's float32 accumulation (in k order, chunk by chunk, part by part), and
// each output's arithmetic depends on neither the row count nor the tile it lands in, so a row
// is bitwise the same alone or batched; its bits differ from the FMA chains of the other builds.
//
// Layout: a W tile is 16 weight rows x 32 k straight from the stored plane (row stride K), so
// the weights are never copied; an x tile is a part of 16 x rows x 32 k in the pair-interleaved
// order the tile unit reads its second operand in (row r holds k = 2r, 2r + 1 of every x row),
// built once a call. A tile's outputs are [W row][x row], transposed into y.
#ifndef KIPP_CUDA_CPU_STORED_AMX_H_
#define KIPP_CUDA_CPU_STORED_AMX_H_

#include <sys/syscall.h>
#include <unistd.h>

namespace amx {

constexpr int64_t kRows = 16;      // W rows per W tile, and x rows per x tile
constexpr int64_t kParts = 3;      // bf16 parts of a float32 x value
constexpr int64_t kTileHalves = kRows * kBlock;  // bf16 values in a tile (1 KB)

// Linux grants AMX's 8 KB of tile state only to a process that asks for it (arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); asked once, it holds for every thread.
inline bool Permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 accumulate, 4-5 hold W, 6-7 hold x: all 16 rows x 64 bytes. Set per unit, since
// the configuration is per thread and other code on XLA's threads may set its own.
inline void Configure() {
  Config config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = kRows;
  _tile_loadconfig(&config);
}

// x rows [16 g, 16 g + 16) as x tiles: xs + ((g * chunks + c) * kParts + p) * kTileHalves is
// part p of k chunk c. Missing rows (past `rows`) are zeros.
inline void Prepare(const float* x, int64_t rows, int64_t k, int64_t g, uint16_t* xs) {
  const int64_t chunks = k / kBlock;
  uint16_t* out = xs + g * chunks * kParts * kTileHalves;
  const int64_t first = g * kRows, count = std::min(kRows, rows - first);
  if (count < kRows) std::memset(out, 0, chunks * kParts * kTileHalves * sizeof(uint16_t));
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512i stride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                              11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(kRows));
  // float32 values -> their top 16 bits, as 16 bf16
  auto halves = [](__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
  };
  for (int64_t j = 0; j < count; ++j) {
    const float* row = x + (first + j) * k;
    for (int64_t c = 0; c < chunks; ++c) {
      __m512 rest[2] = {_mm512_loadu_ps(row + c * kBlock), _mm512_loadu_ps(row + c * kBlock + 16)};
      for (int p = 0; p < kParts; ++p) {
        __m256i part[2];
        for (int h = 0; h < 2; ++h) {
          const __m512 head = p + 1 < kParts
              ? _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(rest[h]), top))
              : rest[h];  // the last part is exact: at most 8 significant bits are left
          part[h] = halves(head);
          rest[h] = _mm512_sub_ps(rest[h], head);  // exact: head is rest's leading bits
        }
        // 32 bf16 = 16 pairs (k = 2r, 2r + 1): pair r goes to tile row r, column j
        const __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(part[0]), part[1], 1);
        int* tile = reinterpret_cast<int*>(out + (c * kParts + p) * kTileHalves) + j;
        _mm512_i32scatter_epi32(tile, stride, pairs, 4);
      }
    }
  }
}

// W tiles at w0 (and w1) against the x tiles at x0 (and x1) over every chunk, into out
// [NA * NB][16][16] (W row, x row): accumulators tile 2a + b.
template <int NA, int NB>
void Block(const uint16_t* w0, const uint16_t* w1, int64_t k, const uint16_t* x0,
           const uint16_t* x1, float* out) {
  const int64_t chunks = k / kBlock, stride = k * static_cast<int64_t>(sizeof(uint16_t));
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (NA == 2) _tile_zero(2);
  if constexpr (NA == 2 && NB == 2) _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(4, w0 + c * kBlock, stride);
    if constexpr (NA == 2) _tile_loadd(5, w1 + c * kBlock, stride);
    for (int64_t p = 0; p < kParts; ++p) {
      const int64_t at = (c * kParts + p) * kTileHalves;
      _tile_loadd(6, x0 + at, 64);
      if constexpr (NB == 2) _tile_loadd(7, x1 + at, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
      if constexpr (NA == 2) _tile_dpbf16ps(2, 5, 6);
      if constexpr (NA == 2 && NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t kOut = kRows * kRows;
  _tile_stored(0, out, 64);
  if constexpr (NB == 2) _tile_stored(1, out + kOut, 64);
  if constexpr (NA == 2) _tile_stored(2, out + (NB == 2 ? 2 : 1) * kOut, 64);
  if constexpr (NA == 2 && NB == 2) _tile_stored(3, out + 3 * kOut, 64);
}

using BlockFn = void (*)(const uint16_t*, const uint16_t*, int64_t, const uint16_t*,
                         const uint16_t*, float*);
constexpr BlockFn kBlocks[2][2] = {{Block<1, 1>, Block<1, 2>}, {Block<2, 1>, Block<2, 2>}};

// W rows per work unit: enough for 2 threads' share of a decode round's few units, and for a
// long round as many as keep the x tiles' trips from L3 few (the unit's W stays in L2).
inline int64_t Group(int64_t rows) { return rows <= kRows ? 2 * kRows : 8 * kRows; }

// Unit u: W rows [u * group, ...) against every x row (xs: Prepare's tiles of all of them),
// x tile pairs outer so a pair stays in L1 across the unit's W tiles. A last W tile short of
// 16 rows is read from a zero-padded copy.
inline void Unit(const uint16_t* xs, const uint16_t* w, float* y, int64_t rows, int64_t k,
                 int64_t n, int64_t group, int64_t u) {
  const int64_t first = u * group, count = std::min(group, n - first);
  const int64_t chunks = k / kBlock, groups = (rows + kRows - 1) / kRows;
  const int64_t tiles = (count + kRows - 1) / kRows, xstride = chunks * kParts * kTileHalves;
  const uint16_t* padded = nullptr;
  if (count % kRows) {
    uint16_t* copy = reinterpret_cast<uint16_t*>(Scratch(kRows * k / 2));
    const int64_t have = count % kRows;
    std::memcpy(copy, w + (first + count - have) * k, have * k * sizeof(uint16_t));
    std::memset(copy + have * k, 0, (kRows - have) * k * sizeof(uint16_t));
    padded = copy;
  }
  auto tile = [&](int64_t t) {
    return t == tiles - 1 && padded ? padded : w + (first + t * kRows) * k;
  };
  alignas(64) float out[4 * kRows * kRows];
  Configure();
  for (int64_t g = 0; g < groups; g += 2) {
    const int64_t nb = std::min<int64_t>(2, groups - g);
    const uint16_t* x0 = xs + g * xstride;
    for (int64_t t = 0; t < tiles; t += 2) {
      const int64_t na = std::min<int64_t>(2, tiles - t);
      kBlocks[na - 1][nb - 1](tile(t), na == 2 ? tile(t + 1) : nullptr, k, x0,
                              nb == 2 ? x0 + xstride : nullptr, out);
      for (int64_t a = 0; a < na; ++a) {
        for (int64_t b = 0; b < nb; ++b) {
          const float* o = out + (a * nb + b) * kRows * kRows;
          const int64_t n0 = first + (t + a) * kRows, m0 = (g + b) * kRows;
          const int64_t wn = std::min(kRows, first + count - n0);
          const int64_t xm = std::min(kRows, rows - m0);
          for (int64_t j = 0; j < xm; ++j)
            for (int64_t i = 0; i < wn; ++i) y[(m0 + j) * n + n0 + i] = o[i * kRows + j];
        }
      }
    }
  }
  _tile_release();
}

}  // namespace amx

#endif  // KIPP_CUDA_CPU_STORED_AMX_H_
