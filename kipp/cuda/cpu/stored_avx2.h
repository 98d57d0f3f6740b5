// The AVX2 + FMA arm of Kipp's stored CPU matmul: stored_matmul.cc includes it, after its
// shared definitions, in the build for AVX2 + FMA + F16C without AVX-512 (kipp/cuda/cpu/
// matmul.py's Isa.AVX2). Without it that build decodes blocks in plain C++, 5 to 20 times
// slower than the AVX-512 build's vectors (its int8 dot is stored_int8.h's AVX2 arm).
//
// The same numerics as every other build, in 8-float halves: stored_matmul.cc's 16-lane chain
// per output is two 8-lane chains here (lanes 0-7 and 8-15 of each 16-weight step), each fed
// in k order, then Sum16's add tree; so each output's bits equal the AVX-512 and plain builds'
// (tests/test_cpu_stored_matmul.py builds each and compares them bitwise). Tiles are sized for
// AVX2's 16 vector registers: two accumulators per output. Decode rounds run in spans of K
// as the other builds' do (stored_matmul.cc's SpanBlocks: a round whose x rows overflow L1
// would read them again from L2 for every W row), and their tiles prefetch the W rows a few
// tiles ahead (PrefetchAhead): side-by-side row streams outrun the hardware prefetcher here
// too.
#ifndef KIPP_CUDA_CPU_STORED_AVX2_H_
#define KIPP_CUDA_CPU_STORED_AVX2_H_

namespace avx2 {

// Block `at` (its index in the d and m planes) as four 8-float vectors, elements 0-7, 8-15,
// 16-23 and 24-31: DecodeBlock's values exactly (affine4's product d * q is exact, so the fused
// d * q + m rounds once, as its multiply then add does).
template <Format F>
inline void Decode(const void* w, const uint16_t* d, const uint16_t* m, int64_t at,
                   __m256 out[4]) {
  if constexpr (F == Format::kBf16) {
    const uint16_t* bits = static_cast<const uint16_t*>(w) + at * kBlock;
    for (int i = 0; i < 4; ++i) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + 8 * i));
      out[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  } else if constexpr (F == Format::kQ8_0) {
    const int8_t* q = static_cast<const int8_t*>(w) + at * kBlock;
    const __m256 scale = _mm256_set1_ps(_cvtsh_ss(d[at]));
    for (int i = 0; i < 4; ++i) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
      out[i] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    }
  } else {  // byte j's low nibble is element j, its high nibble element j + 16
    const uint8_t* q = static_cast<const uint8_t*>(w) + at * 16;
    const __m256 scale = _mm256_set1_ps(_cvtsh_ss(d[at]));
    const __m256i mask = _mm256_set1_epi32(0x0f);
    for (int i = 0; i < 2; ++i) {
      const __m256i wide =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)));
      const __m256i a = _mm256_and_si256(wide, mask), c = _mm256_srli_epi32(wide, 4);
      if constexpr (F == Format::kScale4) {  // d * (q - 8), q - 8 in the integer lanes (exact)
        const __m256i eight = _mm256_set1_epi32(8);
        out[i] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_sub_epi32(a, eight)));
        out[i + 2] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_sub_epi32(c, eight)));
      } else {  // d * q + m
        const __m256 low = _mm256_set1_ps(_cvtsh_ss(m[at]));
        out[i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(a), low);
        out[i + 2] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(c), low);
      }
    }
  }
}

// Sum16 of the 16 lanes (lo, hi): lo + hi, then 4, 2 and 1 apart.
inline float Sum(__m256 lo, __m256 hi) {
  v16 v;
  std::memcpy(&v, &lo, 32), std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return Sum16(v);
}

// R rows of x (a decode round) against W rows n0 .. n0 + C - 1, each block decoded into
// registers once per W row: FusedTile's chains (element j of a block feeds half (j / 8) % 2),
// over blocks [b0, b1) of K as stored_matmul.cc's FusedTile runs its spans. The chains start
// from `carry` unless b0 is the first block and end there unless b1 is past the last; output
// (r, c)'s pair of chains is carry[2 * (c * stride + r)]: parked and picked up again, the same
// chains, so spans change no output's bits.
template <Format F, int R, int C>
void FusedTile(const float* x, int64_t k, const void* w, const uint16_t* d, const uint16_t* m,
               int64_t n0, int64_t b0, int64_t b1, __m256* carry, int64_t stride, float* y,
               int64_t ldy) {
  const int64_t blocks = k / kBlock;
  __m256 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h)
        acc[r][c][h] = b0 == 0 ? _mm256_setzero_ps() : carry[2 * (c * stride + r) + h];
  for (int64_t b = b0; b < b1; ++b) {
    PrefetchAhead<F, C>(w, d, m, n0 + kPrefetchTiles * C, b, blocks);  // as FusedTile's
    for (int c = 0; c < C; ++c) {
      __m256 wv[4];
      Decode<F>(w, d, m, (n0 + c) * blocks + b, wv);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * k + b * kBlock;
        for (int i = 0; i < 4; ++i) {
          acc[r][c][i & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * i), wv[i],
                                             acc[r][c][i & 1]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      if (b1 < blocks) {
        for (int h = 0; h < 2; ++h) carry[2 * (c * stride + r) + h] = acc[r][c][h];
      } else {
        y[r * ldy + n0 + c] = Sum(acc[r][c][0], acc[r][c][1]);
      }
    }
}

// Tiles of up to 4 x rows; W rows per tile as many as keep 2 * R * C accumulators at 8 or fewer.
constexpr int kRows = 4;
constexpr int Width(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

// A decode round's tile as Fused's table holds it.
using SpanTileFn = void (*)(const float*, int64_t, const void*, const uint16_t*,
                            const uint16_t*, int64_t, int64_t, int64_t, __m256*, int64_t,
                            float*, int64_t);
template <Format F>
struct Fused {
  static constexpr SpanTileFn kTiles[kRows][kTile] = {
      {FusedTile<F, 1, 1>, FusedTile<F, 1, 2>, FusedTile<F, 1, 3>, FusedTile<F, 1, 4>},
      {FusedTile<F, 2, 1>, FusedTile<F, 2, 2>, nullptr, nullptr},
      {FusedTile<F, 3, 1>, nullptr, nullptr, nullptr},
      {FusedTile<F, 4, 1>, nullptr, nullptr, nullptr}};
};

// R rows of x against C decoded W rows (scratch rows, stride k): Tile's chains.
template <int R, int C>
void Tile(const float* x, int64_t k, const float* w, float* y, int64_t ldy) {
  __m256 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += kLanes) {
    for (int h = 0; h < 2; ++h) {
      __m256 wv[C];
      for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * k + i + 8 * h);
      for (int r = 0; r < R; ++r) {
        __m256 xv = _mm256_loadu_ps(x + r * k + i + 8 * h);
        asm("" : "+x"(xv));  // as stored_matmul.cc's Pin: one load for the C FMAs, not C
        for (int c = 0; c < C; ++c) acc[r][c][h] = _mm256_fmadd_ps(xv, wv[c], acc[r][c][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = Sum(acc[r][c][0], acc[r][c][1]);
}

// A long round's tiles: 3 x rows by 2 W rows (12 accumulators, 2 weight vectors, one x held
// in a register).
constexpr int64_t kLongRows = 3, kLongCols = 2;
constexpr TileFn kTiles[kLongRows][kLongCols] = {
    {Tile<1, 1>, Tile<1, 2>}, {Tile<2, 1>, Tile<2, 2>}, {Tile<3, 1>, Tile<3, 2>}};

// stored_matmul.cc's Unit: W rows [u * group, ...) against all M rows of x. A decode round
// runs span by span, its rows in chunks of kRows over each tile of W rows (the tile's weights
// stay in L1 from one chunk to the next); a longer one decodes the group into the scratch
// first.
template <Format F>
void Unit(const float* x, const void* w, const uint16_t* d, const uint16_t* m, float* y,
          int64_t rows, int64_t k, int64_t n, int64_t group, int64_t u) {
  const int64_t first = u * group, count = std::min(group, n - first);
  if (rows <= kFusedRows) {
    const int64_t blocks = k / kBlock, span = SpanBlocks(rows, blocks);
    alignas(32) __m256 carry[2 * kGroup * kFusedRows];  // W row c's chains from 2 * c * rows
    for (int64_t b0 = 0; b0 < blocks; b0 += span) {
      const int64_t b1 = std::min(blocks, b0 + span);
      for (int64_t c = 0; c < count; c += kTile) {
        const int64_t tc = std::min(kTile, count - c);
        for (int64_t r = 0; r < rows; r += kRows) {
          const int64_t tr = std::min<int64_t>(kRows, rows - r), width = Width(tr);
          for (int64_t j = 0; j < tc; j += width) {
            Fused<F>::kTiles[tr - 1][std::min(width, tc - j) - 1](
                x + r * k, k, w, d, m, first + c + j, b0, b1,
                carry + 2 * ((c + j) * rows + r), rows, y + r * n, n);
          }
        }
      }
    }
    return;
  }
  float* scratch = Scratch(group * k);
  const int64_t blocks = k / kBlock;
  for (int64_t c = 0; c < count; ++c) {
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 wv[4];
      Decode<F>(w, d, m, (first + c) * blocks + b, wv);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(scratch + c * k + b * kBlock + 8 * i, wv[i]);
    }
  }
  for (int64_t r = 0; r < rows; r += kLongRows) {
    const int64_t tr = std::min(kLongRows, rows - r);
    for (int64_t c = 0; c < count; c += kLongCols) {
      const int64_t tc = std::min(kLongCols, count - c);
      kTiles[tr - 1][tc - 1](x + r * k, k, scratch + c * k, y + r * n + first + c, n);
    }
  }
}

}  // namespace avx2

#endif  // KIPP_CUDA_CPU_STORED_AVX2_H_
