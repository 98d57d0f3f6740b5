// The int8 dot of Kipp's stored CPU matmul (Dot::kInt8), every build: stored_matmul.cc
// includes it after its shared definitions.
//
// As llama.cpp's q8_0 x q8_0 dot: each row of x becomes per 32-block an int8 vector q and a
// scale dx = max |x| / 127 (q = round(x / dx)). Block b's dot with a weight row is then an
// exact integer i_b, the sum of its 32 products with the weights' signed values (q8_0's q,
// scale4's q - 8, affine4's q), and the float32 work is per block, not per weight. Output
// y[m][n] is 16 chains, chain j taking blocks b = j, j + 16, j + 32, ... in order:
//   c_j = fma(d_b * dx_b, float(i_b), c_j), then for affine4 c_j = fma(m_b, t_b, c_j),
// with t_b = dx_b * float(sum of the block's q), and y = Sum16(c). Every build gets i_b its own
// exact way and runs these float operations as written, so every build, row count, tile and
// thread split gives the same bits. A span is 16 consecutive blocks: one step of every chain;
// a row's last span's missing blocks add zero (fma(0, 0, c) is c: no chain is ever -0).
//
// The AVX-512 VNNI build reads a span of a weight row transposed: vector i holds bytes
// 4i .. 4i + 3 of each of the span's blocks, lane j block j (a few permutes a span, shared by
// the tile's x rows), so vpdpbusd over the 8 vectors leaves each block's whole integer dot in
// its own lane, and an x row pays one conversion, one multiply and one FMA for 16 blocks
// (512 products). x is quantized into the same order. The AVX2 build does the same in half
// spans of 8 blocks (vpmaddubsw and vpmaddwd for vpdpbusd); the plain build loops.
#ifndef KIPP_CUDA_CPU_STORED_INT8_H_
#define KIPP_CUDA_CPU_STORED_INT8_H_

namespace int8 {

constexpr int64_t kSpan = 16;  // blocks per span: one step of the 16 chains
constexpr int kRows = 8;       // x rows per tile (their spans stay in L1 over a W row)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KIPP_INT8_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KIPP_INT8_AVX2 1
#endif

// One span of one quantized x row. Missing blocks (past the row's end) are zeros.
struct alignas(64) QSpan {
  // VNNI: [dword i][block j][4 bytes]; AVX2: [half j / 8][dword i][block j % 8][4]; plain:
  // [block j][32]
  int8_t q[kSpan * kBlock];
  float dx[kSpan];
  // added to an unsigned integer dot: -128 * sum q where q8_0's weights are read as q + 128
  // (VNNI), -8 * sum q for scale4's q - 8, else 0
  int32_t corr[kSpan];
  float t[kSpan];  // dx * sum q: affine4's m term
};

// Block v[32] -> its dx and q[j] = v[j] / dx rounded half to even, clamped to +-127 (q left
// as it is where dx is 0 or NaN). The build with AVX2 runs the scalar steps eight lanes at a
// time: the maximum of |v| is exact in any order, and the division, rounding and clamps are
// the same IEEE operations lane by lane, so every build gets the same bits.
inline float QuantizeBlock(const float* v, int8_t q[kBlock]) {
#if defined(__AVX2__)
  __m256 x[4], amax = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x[i]);
    amax = _mm256_max_ps(amax, a);
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_LT_OQ));
  }
  // a NaN or inf in x makes the row's outputs NaN (as the float32 dot would), not a clamp
  if (_mm256_movemask_ps(finite) != 0xff) return std::numeric_limits<float>::quiet_NaN();
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float dx = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1))) / 127.0f;
  if (dx == 0.0f) return dx;
  __m256i n[4];
  for (int i = 0; i < 4; ++i) {  // x / dx, not x * (1 / dx): 1 / a subnormal is inf
    const __m256 r = _mm256_round_ps(_mm256_div_ps(x[i], _mm256_set1_ps(dx)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    n[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_set1_ps(127.0f),
                                            _mm256_max_ps(r, _mm256_set1_ps(-127.0f))));
  }
  // the packs interleave the 128-bit halves; the permute puts the elements back in order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]),
                                           _mm256_packs_epi32(n[2], n[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  return dx;
#else
  float amax = 0.0f;
  bool finite = true;
  for (int j = 0; j < kBlock; ++j) {
    amax = std::max(amax, std::fabs(v[j]));
    finite = finite && std::isfinite(v[j]);
  }
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  const float dx = amax / 127.0f;
  if (dx == 0.0f) return dx;
  for (int j = 0; j < kBlock; ++j) {  // x / dx, not x * (1 / dx): 1 / a subnormal is inf
    const float r = std::nearbyint(v[j] / dx);
    q[j] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
  return dx;
#endif
}

// x row [k] -> its spans (QuantizeBlock's bits in every build, laid out as the build reads).
template <Format F>
void QuantizeRow(const float* x, int64_t k, QSpan* out) {
  const int64_t blocks = k / kBlock, spans = (blocks + kSpan - 1) / kSpan;
  for (int64_t s = 0; s < spans; ++s) {
    QSpan& o = out[s];
    std::memset(&o, 0, sizeof o);
    for (int64_t j = 0; j < kSpan && s * kSpan + j < blocks; ++j) {
      int8_t q[kBlock] = {};
      const float dx = QuantizeBlock(x + (s * kSpan + j) * kBlock, q);
      int32_t sum = 0;
      for (int e = 0; e < kBlock; ++e) sum += q[e];
#if defined(KIPP_INT8_VNNI)
      for (int i = 0; i < kBlock / 4; ++i) std::memcpy(o.q + (i * kSpan + j) * 4, q + 4 * i, 4);
#elif defined(KIPP_INT8_AVX2)
      for (int i = 0; i < kBlock / 4; ++i) {
        std::memcpy(o.q + ((j / 8 * 8 + i) * 8 + j % 8) * 4, q + 4 * i, 4);
      }
#else
      std::memcpy(o.q + j * kBlock, q, kBlock);
#endif
      o.dx[j] = dx;
#if defined(KIPP_INT8_VNNI)
      o.corr[j] = F == Format::kQ8_0 ? -128 * sum : F == Format::kScale4 ? -8 * sum : 0;
#else
      o.corr[j] = F == Format::kScale4 ? -8 * sum : 0;
#endif
      o.t[j] = dx * static_cast<float>(sum);
    }
  }
}

// A tile: R quantized x rows (their spans) against W row n, y[r * ldy + n].
using TileFn = void (*)(const QSpan*, int64_t, int64_t, const void*, const uint16_t*,
                        const uint16_t*, int64_t, float*, int64_t);

#if defined(KIPP_INT8_VNNI)
// ---- AVX-512 VNNI: spans of W transposed in registers ----

// vpermt2d indices (bit 4 picks the second source) of the transposes. A level pairs the
// vectors whose index differs in one bit and swaps that bit with one bit of the lane index:
// out_x[L] = (L's bit ? B : A)[L with that bit x].
struct Indices {
  int32_t v[16];
};
constexpr Indices Swap(int bit, int x) {
  Indices out{};
  for (int l = 0; l < 16; ++l) out.v[l] = (l & ~(1 << bit)) | (x << bit) | (((l >> bit) & 1) << 4);
  return out;
}
// The last levels also put the lanes in block order: lane b takes the source lane whose bits
// (3 down to 0) hold b0, b1, b2 and the output's x at the positions given, from the source b3
// picks. q8_0's vectors start as blocks 2p, 2p + 1 (lane: b0, then dword i2 i1 i0); after two
// swaps the lanes are (b0, i2, b2, b1). The nibble formats' start as blocks 4p .. 4p + 3 (lane:
// b1 b0, then dword i1 i0); after one swap the lanes are (b1, b0, i1, b2).
constexpr Indices Last(int x, int at_b0, int at_b1, int at_b2, int at_x) {
  Indices out{};
  for (int b = 0; b < 16; ++b) {
    const int b3 = b >> 3, b2 = (b >> 2) & 1, b1 = (b >> 1) & 1, b0 = b & 1;
    out.v[b] = (b0 << at_b0 | b1 << at_b1 | b2 << at_b2 | x << at_x) | b3 << 4;
  }
  return out;
}
constexpr Indices kSwap0[2] = {Swap(0, 0), Swap(0, 1)};
constexpr Indices kSwap1[2] = {Swap(1, 0), Swap(1, 1)};
constexpr Indices kQ8Last[2] = {Last(0, 3, 0, 1, 2), Last(1, 3, 0, 1, 2)};
constexpr Indices kNibbleLast[2] = {Last(0, 2, 3, 0, 1), Last(1, 2, 3, 0, 1)};

template <int kVectors>
inline void Level(__m512i* v, int bit, const Indices (&index)[2]) {
  const __m512i i0 = _mm512_loadu_si512(index[0].v), i1 = _mm512_loadu_si512(index[1].v);
  for (int p = 0; p < kVectors; ++p) {
    if (p & bit) continue;
    const __m512i a = v[p], b = v[p | bit];
    v[p] = _mm512_permutex2var_epi32(a, i0, b);
    v[p | bit] = _mm512_permutex2var_epi32(a, i1, b);
  }
}

// The first `bytes` of 64 (0 to 64) as a load mask.
inline __mmask64 Bytes(int64_t bytes) {
  return bytes >= 64 ? ~__mmask64{0} : bytes <= 0 ? 0 : (__mmask64{1} << bytes) - 1;
}

// Span s of weight row n transposed: t[i] lane j = bytes 4i .. 4i + 3 of block j as unsigned
// (q8_0 as q + 128, the nibbles as themselves), with the blocks' d (and m); missing blocks'
// bytes are read as zeros and their scales as 0.
template <Format F>
inline void LoadSpan(const void* w, const uint16_t* d, const uint16_t* m, int64_t n, int64_t s,
                     int64_t blocks, __m512i t[8], __m512* dv, __m512* mv) {
  const int64_t first = s * kSpan, have = std::min(kSpan, blocks - first);
  const int64_t at = n * blocks + first;
  constexpr int64_t kBytes = F == Format::kQ8_0 ? kBlock : kBlock / 2;  // a block's
  const char* q = static_cast<const char*>(w) + at * kBytes;
  constexpr int kVectors = kSpan * kBytes / 64;
  for (int p = 0; p < kVectors; ++p) {
    t[p] = have == kSpan ? _mm512_loadu_si512(q + 64 * p)
                         : _mm512_maskz_loadu_epi8(Bytes(have * kBytes - 64 * p), q + 64 * p);
  }
  if constexpr (F == Format::kQ8_0) {
    for (int p = 0; p < 8; ++p) t[p] = _mm512_xor_si512(t[p], _mm512_set1_epi8(-128));
    Level<8>(t, 1, kSwap0);
    Level<8>(t, 2, kSwap1);
    Level<8>(t, 4, kQ8Last);
  } else {  // byte e's low nibble is element e, its high nibble element e + 16
    Level<4>(t, 1, kSwap0);
    Level<4>(t, 2, kNibbleLast);
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int i = 0; i < 4; ++i) {
      t[i + 4] = _mm512_and_si512(_mm512_srli_epi32(t[i], 4), low);
      t[i] = _mm512_and_si512(t[i], low);
    }
  }
  const __mmask16 scales = have == kSpan ? 0xffff : static_cast<__mmask16>((1u << have) - 1);
  *dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(scales, d + at));
  if constexpr (F == Format::kAffine4) {
    *mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(scales, m + at));
  }
}

// A decode round's tile: each span of W row n loaded and transposed once for all R x rows.
template <Format F, int R>
void Tile(const QSpan* x, int64_t spans, int64_t blocks, const void* w, const uint16_t* d,
          const uint16_t* m, int64_t n, float* y, int64_t ldy) {
  __m512 c[R];
  for (int r = 0; r < R; ++r) c[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < spans; ++s) {
    __m512i t[8];
    __m512 dv, mv = _mm512_setzero_ps();
    LoadSpan<F>(w, d, m, n, s, blocks, t, &dv, &mv);
    for (int r = 0; r < R; ++r) {
      const QSpan& q = x[r * spans + s];
      // two integer chains (exact, so their order is free) halve the vpdpbusd latency chain
      __m512i a0 = _mm512_load_si512(q.corr), a1 = _mm512_setzero_si512();
      for (int i = 0; i < 8; i += 2) {
        a0 = _mm512_dpbusd_epi32(a0, t[i], _mm512_load_si512(q.q + 64 * i));
        a1 = _mm512_dpbusd_epi32(a1, t[i + 1], _mm512_load_si512(q.q + 64 * (i + 1)));
      }
      const __m512 scale = _mm512_mul_ps(dv, _mm512_load_ps(q.dx));
      c[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), c[r]);
      if constexpr (F == Format::kAffine4) c[r] = _mm512_fmadd_ps(mv, _mm512_load_ps(q.t), c[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy + n] = Sum16(reinterpret_cast<v16>(c[r]));
}

// A span of a weight row as LoadSpan leaves it, kept in a long round's scratch.
struct alignas(64) WSpan {
  __m512i t[8];
  __m512 d, m;
};

// A long round's tile: R x rows against the C W rows n .. n + C - 1 whose spans `ws` holds
// (C * spans of them, row by row). Each x vector loaded meets C W rows: loads, not vpdpbusd,
// bound the one-row tiles.
template <Format F, int R, int C>
void LongTile(const QSpan* x, int64_t spans, const WSpan* ws, int64_t n, float* y, int64_t ldy) {
  __m512 c[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) c[r][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < spans; ++s) {
    __m512i t[C][8];
    for (int j = 0; j < C; ++j)
      for (int i = 0; i < 8; ++i) t[j][i] = _mm512_load_si512(ws[j * spans + s].t + i);
    for (int r = 0; r < R; ++r) {
      const QSpan& q = x[r * spans + s];
      const __m512i corr = _mm512_load_si512(q.corr);
      __m512i a[C];
      for (int j = 0; j < C; ++j) a[j] = corr;
      for (int i = 0; i < 8; ++i) {
        const __m512i xq = _mm512_load_si512(q.q + 64 * i);
        for (int j = 0; j < C; ++j) a[j] = _mm512_dpbusd_epi32(a[j], t[j][i], xq);
      }
      const __m512 dx = _mm512_load_ps(q.dx);
      for (int j = 0; j < C; ++j) {
        const __m512 scale = _mm512_mul_ps(_mm512_load_ps(&ws[j * spans + s].d), dx);
        c[r][j] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(a[j]), c[r][j]);
        if constexpr (F == Format::kAffine4) {
          c[r][j] = _mm512_fmadd_ps(_mm512_load_ps(&ws[j * spans + s].m), _mm512_load_ps(q.t),
                                    c[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) y[r * ldy + n + j] = Sum16(reinterpret_cast<v16>(c[r][j]));
}

constexpr int kLongRows = 4, kLongCols = 2;

// A long round's unit: each W row's spans transposed once into this thread's scratch, then
// run against every tile of x rows (the transposes would otherwise repeat per tile).
template <Format F>
void LongUnit(const QSpan* x, const void* w, const uint16_t* d, const uint16_t* m, float* y,
              int64_t rows, int64_t k, int64_t n, int64_t group, int64_t u) {
  using Fn = void (*)(const QSpan*, int64_t, const WSpan*, int64_t, float*, int64_t);
  static constexpr Fn kTiles[kLongRows][kLongCols] = {
      {LongTile<F, 1, 1>, LongTile<F, 1, 2>}, {LongTile<F, 2, 1>, LongTile<F, 2, 2>},
      {LongTile<F, 3, 1>, LongTile<F, 3, 2>}, {LongTile<F, 4, 1>, LongTile<F, 4, 2>}};
  const int64_t blocks = k / kBlock, spans = (blocks + kSpan - 1) / kSpan;
  const int64_t first = u * group, count = std::min(group, n - first);
  thread_local std::unique_ptr<WSpan, decltype(&std::free)> scratch(nullptr, &std::free);
  thread_local int64_t capacity = 0;
  if (capacity < count * spans) {
    scratch.reset(static_cast<WSpan*>(std::aligned_alloc(64, count * spans * sizeof(WSpan))));
    if (!scratch) throw std::bad_alloc();
    capacity = count * spans;
  }
  WSpan* ws = scratch.get();
  for (int64_t c = 0; c < count; ++c) {
    for (int64_t s = 0; s < spans; ++s) {
      WSpan& o = ws[c * spans + s];
      __m512 mv = _mm512_setzero_ps();
      LoadSpan<F>(w, d, m, first + c, s, blocks, o.t, &o.d, &mv);
      o.m = mv;
    }
  }
  for (int64_t r = 0; r < rows; r += kLongRows) {
    const int64_t tr = std::min<int64_t>(kLongRows, rows - r);
    for (int64_t c = 0; c < count; c += kLongCols) {
      const int64_t tc = std::min<int64_t>(kLongCols, count - c);
      kTiles[tr - 1][tc - 1](x + r * spans, spans, ws + c * spans, first + c, y + r * n, n);
    }
  }
}

#elif defined(KIPP_INT8_AVX2)
// ---- AVX2: half spans (8 blocks) of W transposed, as the VNNI build's spans ----

// Eight fp16 scales from `plane`, the first `have` of them (the rest 0).
inline __m256 Scales8(const uint16_t* plane, int64_t have) {
  if (have >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(plane)));
  uint16_t part[8] = {};
  std::memcpy(part, plane, have * sizeof(uint16_t));
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(part)));
}

// The 8 blocks from block `at` of a weight plane transposed: t[i] lane j = bytes 4i .. 4i + 3
// of block j (q8_0 signed as stored, the nibbles unsigned, low nibbles in t[0..3], high in
// t[4..7]); blocks from `have` on read as zeros.
template <Format F>
inline void LoadHalf(const void* w, int64_t at, int64_t have, __m256i t[8]) {
  constexpr int64_t kBytes = F == Format::kQ8_0 ? kBlock : kBlock / 2;  // a block's
  const char* q = static_cast<const char*>(w) + at * kBytes;
  alignas(32) char part[8 * kBytes];
  if (have < 8) {  // a row's last half span: its blocks, then zeros
    std::memset(part, 0, sizeof part);
    std::memcpy(part, q, have * kBytes);
    q = part;
  }
  if constexpr (F == Format::kQ8_0) {  // an 8 x 8 transpose of dwords (block j's in row j)
    __m256i r[8], u[8];
    for (int j = 0; j < 8; ++j) {
      r[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * j));
    }
    for (int j = 0; j < 8; j += 2) {
      u[j] = _mm256_unpacklo_epi32(r[j], r[j + 1]);
      u[j + 1] = _mm256_unpackhi_epi32(r[j], r[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
      r[j] = _mm256_unpacklo_epi64(u[j], u[j + 2]);
      r[j + 1] = _mm256_unpackhi_epi64(u[j], u[j + 2]);
      r[j + 2] = _mm256_unpacklo_epi64(u[j + 1], u[j + 3]);
      r[j + 3] = _mm256_unpackhi_epi64(u[j + 1], u[j + 3]);
    }
    for (int i = 0; i < 4; ++i) {
      t[i] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x20);
      t[i + 4] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x31);
    }
  } else {  // vector p holds blocks 2p and 2p + 1 (a 128-bit lane each) of 4 dwords
    __m256i y[4], u[4];
    for (int p = 0; p < 4; ++p) {
      y[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * p));
    }
    u[0] = _mm256_unpacklo_epi32(y[0], y[1]);
    u[1] = _mm256_unpackhi_epi32(y[0], y[1]);
    u[2] = _mm256_unpacklo_epi32(y[2], y[3]);
    u[3] = _mm256_unpackhi_epi32(y[2], y[3]);
    // dword i of blocks (0, 2, 4, 6 | 1, 3, 5, 7), then in block order
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int i = 0; i < 4; ++i) {
      const __m256i a = i % 2 ? _mm256_unpackhi_epi64(u[i / 2], u[i / 2 + 2])
                              : _mm256_unpacklo_epi64(u[i / 2], u[i / 2 + 2]);
      const __m256i v = _mm256_permutevar8x32_epi32(a, order);
      t[i] = _mm256_and_si256(v, low);
      t[i + 4] = _mm256_and_si256(_mm256_srli_epi32(v, 4), low);
    }
  }
}

template <Format F, int R>
void Tile(const QSpan* x, int64_t spans, int64_t blocks, const void* w, const uint16_t* d,
          const uint16_t* m, int64_t n, float* y, int64_t ldy) {
  __m256 c[R][2];
  for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t s = 0; s < spans; ++s) {
    for (int h = 0; h < 2; ++h) {  // the span's blocks 8h .. 8h + 7
      const int64_t first = s * kSpan + 8 * h, have = std::min<int64_t>(8, blocks - first);
      if (have <= 0) break;
      const int64_t at = n * blocks + first;
      __m256i t[8], magnitude[8];
      LoadHalf<F>(w, at, have, t);
      if constexpr (F == Format::kQ8_0) {
        for (int i = 0; i < 8; ++i) magnitude[i] = _mm256_sign_epi8(t[i], t[i]);  // |w|
      }
      const __m256 dv = Scales8(d + at, have);
      const __m256 mv = F == Format::kAffine4 ? Scales8(m + at, have) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const QSpan& q = x[r * spans + s];
        const int8_t* xq = q.q + h * 8 * kBlock;
        __m256i dot;
        if constexpr (F == Format::kQ8_0) {  // |w| times x with w's sign: no int16 overflow
          dot = _mm256_setzero_si256();
          for (int i = 0; i < 8; ++i) {
            const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq + 32 * i));
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(
                _mm256_maddubs_epi16(magnitude[i], _mm256_sign_epi8(xv, t[i])), ones));
          }
        } else {  // vpmaddubsw sums two nibble products (at most 2 * 15 * 127): eight fit int16
          __m256i pairs = _mm256_setzero_si256();
          for (int i = 0; i < 8; ++i) {
            const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq + 32 * i));
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(t[i], xv));
          }
          dot = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), _mm256_load_si256(
                                     reinterpret_cast<const __m256i*>(q.corr + 8 * h)));
        }
        const __m256 scale = _mm256_mul_ps(dv, _mm256_load_ps(q.dx + 8 * h));
        c[r][h] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), c[r][h]);
        if constexpr (F == Format::kAffine4) {
          c[r][h] = _mm256_fmadd_ps(mv, _mm256_load_ps(q.t + 8 * h), c[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    v16 lanes;
    std::memcpy(&lanes, c[r], sizeof lanes);
    y[r * ldy + n] = Sum16(lanes);
  }
}

#else
// ---- plain C++ ----

template <Format F>
inline int32_t BlockDot(const void* w, int64_t at, const int8_t* q) {
  int32_t dot = 0;
  for (int e = 0; e < kBlock; ++e) {
    int32_t weight;
    if constexpr (F == Format::kQ8_0) {
      weight = static_cast<const int8_t*>(w)[at * kBlock + e];
    } else {
      const uint8_t byte = static_cast<const uint8_t*>(w)[at * 16 + e % 16];
      weight = e < 16 ? byte & 0x0f : byte >> 4;
      if constexpr (F == Format::kScale4) weight -= 8;
    }
    dot += weight * q[e];
  }
  return dot;
}

template <Format F, int R>
void Tile(const QSpan* x, int64_t spans, int64_t blocks, const void* w, const uint16_t* d,
          const uint16_t* m, int64_t n, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r) {
    v16 c = Broadcast16(0.0f);
    for (int64_t s = 0; s < spans; ++s) {
      const QSpan& q = x[r * spans + s];
      for (int64_t j = 0; j < kSpan && s * kSpan + j < blocks; ++j) {
        const int64_t at = n * blocks + s * kSpan + j;
        const float dot = static_cast<float>(BlockDot<F>(w, at, q.q + j * kBlock));
        c[j] = std::fma(Half(d[at]) * q.dx[j], dot, c[j]);
        if constexpr (F == Format::kAffine4) c[j] = std::fma(Half(m[at]), q.t[j], c[j]);
      }
    }
    y[r * ldy + n] = Sum16(c);
  }
}
#endif

template <Format F>
struct Tiles {
  static constexpr TileFn kTiles[kRows] = {Tile<F, 1>, Tile<F, 2>, Tile<F, 3>, Tile<F, 4>,
                                           Tile<F, 5>, Tile<F, 6>, Tile<F, 7>, Tile<F, 8>};
};

// Unit u: W rows [u * group, ...) against every quantized x row, in tiles of up to kRows x rows
// by one W row (a unit's W rows, read again for each tile of x rows, stay in L2).
template <Format F>
void Unit(const QSpan* x, const void* w, const uint16_t* d, const uint16_t* m, float* y,
          int64_t rows, int64_t k, int64_t n, int64_t group, int64_t u) {
#if defined(KIPP_INT8_VNNI)
  if (rows > kRows) return LongUnit<F>(x, w, d, m, y, rows, k, n, group, u);
#endif
  const int64_t blocks = k / kBlock, spans = (blocks + kSpan - 1) / kSpan;
  const int64_t first = u * group, count = std::min(group, n - first);
  for (int64_t r = 0; r < rows; r += kRows) {
    const TileFn tile = Tiles<F>::kTiles[std::min<int64_t>(kRows, rows - r) - 1];
    for (int64_t c = 0; c < count; ++c) {
      tile(x + r * spans, spans, blocks, w, d, m, first + c, y + r * n, n);
    }
  }
}

}  // namespace int8

#endif  // KIPP_CUDA_CPU_STORED_INT8_H_
