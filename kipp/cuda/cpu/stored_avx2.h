// The AVX2 + FMA arm of Kipp's stored CPU matmul: stored_matmul.cc includes it, after its
// shared definitions, in the build for AVX2 + FMA + F16C without AVX-512 (kipp/cuda/cpu/
// matmul.py's Isa.AVX2). Without it that build decodes blocks and runs the int8 dot in plain
// C++, 5 to 20 times slower than the AVX-512 build's vectors.
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
  const __m256 a = _mm256_add_ps(lo, hi);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
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

// ---- the int8 dot ----

// A weight pair (LoadPair's bytes) as two 32-byte halves, lanes 0-7 and 8-15: q8_0's bytes as
// stored (signed: maddubs takes |w| and moves w's sign onto x), the nibble formats' unsigned;
// each lane's block d (and m). The nibble formats' halves hold the same two blocks in the same
// lanes (lane l's block is (l / 4) % 2), so their d[1] and m[1] are d[0] and m[0].
struct Pair {
  __m256i a[2];
  __m256 d[2], m[2];
};

// The fp16 scales plane[at], plane[at + 1] as a nibble half's lanes: the first block's in
// lanes 0-3, the second's in lanes 4-7.
inline __m256 NibbleScales(const uint16_t* plane, int64_t at) {
  uint32_t two;
  std::memcpy(&two, plane + at, sizeof two);
  const __m128 pair = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(two)));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair),
                                  _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// Weight row n's pair p; `kTail`: the pair's second block is past the row's end (its bytes and
// scales read as zeros).
template <Format F, bool kTail>
inline void LoadPair(const void* w, const uint16_t* d, const uint16_t* m, int64_t n, int64_t p,
                     int64_t blocks, Pair* out) {
  const int64_t at = n * blocks + 2 * p;
  if constexpr (F == Format::kQ8_0) {
    const int8_t* q = static_cast<const int8_t*>(w) + at * kBlock;
    out->a[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    out->a[1] = kTail ? _mm256_setzero_si256()
                      : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kBlock));
  } else {
    const uint8_t* q = static_cast<const uint8_t*>(w) + at * 16;
    const __m256i v =
        kTail ? _mm256_set_m128i(_mm_setzero_si128(),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))
              : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i mask = _mm256_set1_epi8(0x0f);
    out->a[0] = _mm256_and_si256(v, mask);
    out->a[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  }
  // lane l's block: q8_0 l / 8 (half 0 the first block, half 1 the second), the nibble
  // formats (l / 4) % 2
  auto spread = [&](const uint16_t* plane, __m256 half[2]) {
    if constexpr (kTail) {  // one scale; the missing block's is 0
      const float one = _cvtsh_ss(plane[at]);
      half[0] = F == Format::kQ8_0 ? _mm256_set1_ps(one)
                                   : _mm256_setr_ps(one, one, one, one, 0, 0, 0, 0);
      half[1] = F == Format::kQ8_0 ? _mm256_setzero_ps() : half[0];
    } else if constexpr (F == Format::kQ8_0) {
      half[0] = _mm256_set1_ps(_cvtsh_ss(plane[at]));
      half[1] = _mm256_set1_ps(_cvtsh_ss(plane[at + 1]));
    } else {
      half[0] = half[1] = NibbleScales(plane, at);
    }
  };
  spread(d, out->d);
  if constexpr (F == Format::kAffine4) spread(m, out->m);
}

// acc + d * dx * (a . q + corr) per lane (+ m * t for affine4): PairDot's operations. q8_0's
// integer dot is the signed one directly (the other builds' unsigned a . q plus corr = -128 *
// sum q gives the same integer); no pair of products overflows maddubs' int16 (2 * 128 * 127).
// The nibble formats' halves share d and dx lane for lane, so d * dx is one product.
template <Format F>
inline void PairDot(const QPair& x, const Pair& a, __m256 acc[2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 shared = _mm256_mul_ps(a.d[0], _mm256_load_ps(x.dx));
  for (int h = 0; h < 2; ++h) {
    const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(x.q + 32 * h));
    __m256i dot;
    if constexpr (F == Format::kQ8_0) {
      dot = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(a.a[h], a.a[h]),
                                                   _mm256_sign_epi8(q, a.a[h])), ones);
    } else {
      dot = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a.a[h], q), ones),
                             _mm256_load_si256(reinterpret_cast<const __m256i*>(x.corr + 8 * h)));
    }
    const __m256 s = F == Format::kQ8_0 && h == 1
        ? _mm256_mul_ps(a.d[1], _mm256_load_ps(x.dx + 8)) : shared;
    acc[h] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(dot), acc[h]);
    if constexpr (F == Format::kAffine4) {
      acc[h] = _mm256_fmadd_ps(a.m[h], _mm256_load_ps(x.t + 8 * h), acc[h]);
    }
  }
}

// QTile's chains: R quantized x rows against W rows n0 .. n0 + C - 1, pair by pair: the pairs
// with both blocks, then a lone last block's (its checks kept out of the loop).
template <Format F, int R, int C>
void QTile(const QPair* x, int64_t pairs, int64_t blocks, const void* w, const uint16_t* d,
           const uint16_t* m, int64_t n0, float* y, int64_t ldy) {
  __m256 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  const int64_t whole = blocks / 2;
  for (int64_t p = 0; p < whole; ++p) {
    // C side-by-side rows are prefetched, as FusedTile's; one row's sequential stream ran
    // slower with it
    for (int64_t b = 2 * p; C > 1 && b < 2 * p + 2; ++b) {
      PrefetchAhead<F, C>(w, d, m, n0 + kPrefetchTiles * C, b, blocks);
    }
    for (int c = 0; c < C; ++c) {
      Pair a;
      LoadPair<F, false>(w, d, m, n0 + c, p, blocks, &a);
      for (int r = 0; r < R; ++r) PairDot<F>(x[r * pairs + p], a, acc[r][c]);
    }
  }
  if (whole < pairs) {
    for (int c = 0; c < C; ++c) {
      Pair a;
      LoadPair<F, true>(w, d, m, n0 + c, whole, blocks, &a);
      for (int r = 0; r < R; ++r) PairDot<F>(x[r * pairs + whole], a, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + n0 + c] = Sum(acc[r][c][0], acc[r][c][1]);
}

template <Format F>
struct QTiles {
  static constexpr QTileFn kTiles[kRows][kTile] = {
      {QTile<F, 1, 1>, QTile<F, 1, 2>, QTile<F, 1, 3>, QTile<F, 1, 4>},
      {QTile<F, 2, 1>, QTile<F, 2, 2>, nullptr, nullptr},
      {QTile<F, 3, 1>, nullptr, nullptr, nullptr},
      {QTile<F, 4, 1>, nullptr, nullptr, nullptr}};
};

// stored_matmul.cc's QUnit, with this arm's tiles (up to 4 x rows, Width(rows) W rows).
template <Format F>
void QUnit(const QPair* x, const void* w, const uint16_t* d, const uint16_t* m, float* y,
           int64_t rows, int64_t k, int64_t n, int64_t group, int64_t u) {
  const int64_t blocks = k / kBlock, pairs = (blocks + 1) / 2;
  const int64_t first = u * group, count = std::min(group, n - first);
  for (int64_t r = 0; r < rows; r += kRows) {
    const int64_t tr = std::min<int64_t>(kRows, rows - r), width = Width(tr);
    for (int64_t c = 0; c < count; c += width) {
      QTiles<F>::kTiles[tr - 1][std::min(width, count - c) - 1](x + r * pairs, pairs, blocks,
                                                                w, d, m, first + c, y + r * n,
                                                                n);
    }
  }
}

}  // namespace avx2

#endif  // KIPP_CUDA_CPU_STORED_AVX2_H_
