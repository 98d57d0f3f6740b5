// Kipp's CPU matmul over the artifact's stored weights: y[M, N] = x[M, K] @ W^T with W as the
// "device" layout holds it (kipp/cuda/layout.py), never a float32 copy: BF16 bits [N, K],
// q8_0 int8 [N, K/32, 32] + fp16 d [N, K/32], scale4_gs32 (Q4_0) and affine4_gs32 (Q4_1)
// nibbles [N, K/32, 16] + d (+ m), all stacked over layers [L, ...] and read at `layer`.
//
// A work unit is kGroup output rows of W. Each 32-weight block is decoded exactly as
// kipp/formats/quant.py does (bits << 16; d * q; d * (q - 8); d * q + m), with AVX-512 where
// the CPU has it (the library is built -march=native) and plain C++ otherwise. A decode round
// (up to 8 rows of x) decodes each block once into registers and multiplies every row against
// it; a longer round's unit is as many W rows as fill an L2-sized float32 scratch (16 to 128),
// decoded once and run against the x rows in tiles of up to 6 x rows by 4 W rows, each x
// vector held in a register across the tile's W rows (loads, not FMAs, bounded the 4 x 4
// tile). Either way each stored byte is read once.
//
// Numerics: each output y[m][n] is a 16-lane fused multiply-add chain over k (lane j sums
// k = j, j + 16, ...), in k order, then one fixed add tree over the lanes: the same operations
// whatever the tile, the row count or the thread split, so a row's result is bitwise the same
// alone or batched. The activation stays float32 (no int8 rounding): only the summation order
// differs from the float64 oracle.
#include "kernels.h"

namespace {

namespace ffi = xla::ffi;

typedef float v16 __attribute__((vector_size(64)));

constexpr int64_t kBlock = 32;  // weights per quantization block
constexpr int64_t kLanes = 16;  // accumulator lanes per output
constexpr int64_t kTile = 4;    // W rows per tile
constexpr int64_t kGroup = 16;  // W rows decoded per work unit

inline v16 Load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline v16 Broadcast16(float f) {
  v16 v;
  for (int i = 0; i < 16; ++i) v[i] = f;
  return v;
}

// a * b + c with one rounding per lane (as kipp::Fma: never left to the compiler's contraction).
inline v16 Fma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                               reinterpret_cast<__m512>(b),
                                               reinterpret_cast<__m512>(c)));
#else
  kipp::v8 lo[3], hi[3];
  std::memcpy(lo, &a, 32), std::memcpy(hi, reinterpret_cast<char*>(&a) + 32, 32);
  std::memcpy(lo + 1, &b, 32), std::memcpy(hi + 1, reinterpret_cast<char*>(&b) + 32, 32);
  std::memcpy(lo + 2, &c, 32), std::memcpy(hi + 2, reinterpret_cast<char*>(&c) + 32, 32);
  const kipp::v8 l = kipp::Fma(lo[0], lo[1], lo[2]), h = kipp::Fma(hi[0], hi[1], hi[2]);
  v16 out;
  std::memcpy(&out, &l, 32), std::memcpy(reinterpret_cast<char*>(&out) + 32, &h, 32);
  return out;
#endif
}

// Keeps v in a register: without it the compiler folds the x load into every FMA that uses it,
// and loads, not FMAs, bound the tile (a CPU that splits 512-bit loads feels it most).
inline void Pin(v16& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// The lanes' sum in one fixed tree: (0 + 8), then + 4, + 2, + 1 apart. AVX-512 adds the same
// pairs in vector halves (the same bits: each add is the same two floats).
inline float Sum16(v16 v) {
#if defined(__AVX512F__)
  const __m512 z = reinterpret_cast<__m512>(v);
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(z),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
#else
  float a[16];
  std::memcpy(a, &v, sizeof a);
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] = a[i] + a[i + w];
  return a[0];
#endif
}

// IEEE half bits -> float, exactly (every fp16 value, subnormals included, is a float32).
inline float Half(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, frac = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (frac << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (frac << 13);
  } else if (frac == 0) {
    bits = sign;
  } else {  // subnormal: frac * 2**-24, exact in float32
    float f = static_cast<float>(frac) * 5.9604644775390625e-08f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

enum class Format { kBf16, kQ8_0, kScale4, kAffine4 };

// Block b of row n (n within the layer's planes) as float32, quant.py's arithmetic exactly:
// elements 0..15 in *lo, 16..31 in *hi. AVX-512 where the CPU has it, plain C++ otherwise;
// both give the same bits (every step is exact but affine4's one rounded add).
template <Format F>
inline void DecodeBlock(const void* w, const uint16_t* d, const uint16_t* m, int64_t n,
                        int64_t b, int64_t blocks, v16* lo, v16* hi) {
  const int64_t at = n * blocks + b;  // the block's index in the d and m planes
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (F == Format::kBf16) {
    const uint16_t* bits = static_cast<const uint16_t*>(w) + at * kBlock;
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + 16));
    *lo = reinterpret_cast<v16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(l), 16));
    *hi = reinterpret_cast<v16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (F == Format::kQ8_0) {
    const int8_t* q = static_cast<const int8_t*>(w) + at * kBlock;
    const __m512 scale = _mm512_set1_ps(Half(d[at]));
    const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
    *lo = reinterpret_cast<v16>(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(l))));
    *hi = reinterpret_cast<v16>(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h))));
  } else {
    const uint8_t* q = static_cast<const uint8_t*>(w) + at * 16;
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m512 l = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    __m512 h = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
    const __m512 scale = _mm512_set1_ps(Half(d[at]));
    if constexpr (F == Format::kScale4) {
      const __m512 eight = _mm512_set1_ps(8.0f);
      l = _mm512_mul_ps(scale, _mm512_sub_ps(l, eight));
      h = _mm512_mul_ps(scale, _mm512_sub_ps(h, eight));
    } else {
      const __m512 low = _mm512_set1_ps(Half(m[at]));
      l = _mm512_add_ps(_mm512_mul_ps(scale, l), low);
      h = _mm512_add_ps(_mm512_mul_ps(scale, h), low);
    }
    *lo = reinterpret_cast<v16>(l);
    *hi = reinterpret_cast<v16>(h);
  }
#else
  float o[kBlock];
  if constexpr (F == Format::kBf16) {
    const uint16_t* bits = static_cast<const uint16_t*>(w) + at * kBlock;
    for (int j = 0; j < kBlock; ++j) {
      const uint32_t wide = static_cast<uint32_t>(bits[j]) << 16;
      std::memcpy(o + j, &wide, 4);
    }
  } else if constexpr (F == Format::kQ8_0) {
    const int8_t* q = static_cast<const int8_t*>(w) + at * kBlock;
    const float scale = Half(d[at]);
    for (int j = 0; j < kBlock; ++j) o[j] = scale * static_cast<float>(q[j]);
  } else {
    const uint8_t* nib = static_cast<const uint8_t*>(w) + at * 16;
    const float scale = Half(d[at]);
    const float low = F == Format::kAffine4 ? Half(m[at]) : 0.0f;
    for (int j = 0; j < 16; ++j) {
      const float a = static_cast<float>(nib[j] & 0x0f), c = static_cast<float>(nib[j] >> 4);
      if constexpr (F == Format::kScale4) {
        o[j] = scale * (a - 8.0f);
        o[j + 16] = scale * (c - 8.0f);
      } else {  // product exact, one rounding in the add
        o[j] = scale * a + low;
        o[j + 16] = scale * c + low;
      }
    }
  }
  *lo = Load16(o);
  *hi = Load16(o + 16);
#endif
}

// Row n's weights [K] decoded into `out`.
template <Format F>
void DecodeRow(const void* w, const uint16_t* d, const uint16_t* m, int64_t n, int64_t k,
               float* out) {
  const int64_t blocks = k / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    v16 lo, hi;
    DecodeBlock<F>(w, d, m, n, b, blocks, &lo, &hi);
    std::memcpy(out + b * kBlock, &lo, sizeof lo);
    std::memcpy(out + b * kBlock + 16, &hi, sizeof hi);
  }
}

// R rows of x (a decode round) against W rows n0 .. n0 + C - 1 decoded block by
// block into registers: the same FMA chains as Tile over a decoded scratch, without the scratch.
template <Format F, int R, int C>
void FusedTile(const float* x, int64_t k, const void* w, const uint16_t* d, const uint16_t* m,
               int64_t n0, float* y, int64_t ldy) {
  const int64_t blocks = k / kBlock;
  v16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Broadcast16(0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    v16 lo[C], hi[C];
    for (int c = 0; c < C; ++c) DecodeBlock<F>(w, d, m, n0 + c, b, blocks, lo + c, hi + c);
    for (int r = 0; r < R; ++r) {
      const v16 xl = Load16(x + r * k + b * kBlock), xh = Load16(x + r * k + b * kBlock + 16);
      for (int c = 0; c < C; ++c) acc[r][c] = Fma16(xh, hi[c], Fma16(xl, lo[c], acc[r][c]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + n0 + c] = Sum16(acc[r][c]);
}

// Tiles of a decode round: up to 4 rows x 4 W rows, 5 to 8 rows x 2 W rows (16 accumulators).
constexpr int kFusedRows = 8;
template <Format F>
struct Fused {
  using Fn = void (*)(const float*, int64_t, const void*, const uint16_t*, const uint16_t*,
                      int64_t, float*, int64_t);
  static constexpr int Width(int rows) { return rows <= 4 ? 4 : 2; }
  static constexpr Fn kTiles[kFusedRows][kTile] = {
      {FusedTile<F, 1, 1>, FusedTile<F, 1, 2>, FusedTile<F, 1, 3>, FusedTile<F, 1, 4>},
      {FusedTile<F, 2, 1>, FusedTile<F, 2, 2>, FusedTile<F, 2, 3>, FusedTile<F, 2, 4>},
      {FusedTile<F, 3, 1>, FusedTile<F, 3, 2>, FusedTile<F, 3, 3>, FusedTile<F, 3, 4>},
      {FusedTile<F, 4, 1>, FusedTile<F, 4, 2>, FusedTile<F, 4, 3>, FusedTile<F, 4, 4>},
      {FusedTile<F, 5, 1>, FusedTile<F, 5, 2>, nullptr, nullptr},
      {FusedTile<F, 6, 1>, FusedTile<F, 6, 2>, nullptr, nullptr},
      {FusedTile<F, 7, 1>, FusedTile<F, 7, 2>, nullptr, nullptr},
      {FusedTile<F, 8, 1>, FusedTile<F, 8, 2>, nullptr, nullptr}};
};

// R rows of x against C decoded W rows (scratch rows, stride k): y[r][c].
template <int R, int C>
void Tile(const float* x, int64_t k, const float* w, float* y, int64_t ldy) {
  v16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Broadcast16(0.0f);
  for (int64_t i = 0; i < k; i += kLanes) {
    v16 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Load16(w + c * k + i);
    for (int r = 0; r < R; ++r) {
      v16 xv = Load16(x + r * k + i);
      Pin(xv);
      for (int c = 0; c < C; ++c) acc[r][c] = Fma16(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = Sum16(acc[r][c]);
}

// Tiles of a long round: up to 6 x rows by 4 W rows (24 accumulators, 4 weight vectors and
// one x vector: 29 of AVX-512's 32 registers).
constexpr int64_t kLongRows = 6;
using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t);
constexpr TileFn kTiles[kLongRows][kTile] = {
    {Tile<1, 1>, Tile<1, 2>, Tile<1, 3>, Tile<1, 4>},
    {Tile<2, 1>, Tile<2, 2>, Tile<2, 3>, Tile<2, 4>},
    {Tile<3, 1>, Tile<3, 2>, Tile<3, 3>, Tile<3, 4>},
    {Tile<4, 1>, Tile<4, 2>, Tile<4, 3>, Tile<4, 4>},
    {Tile<5, 1>, Tile<5, 2>, Tile<5, 3>, Tile<5, 4>},
    {Tile<6, 1>, Tile<6, 2>, Tile<6, 3>, Tile<6, 4>}};

// W rows per work unit: kGroup for a decode round; for a long round as many as fill about
// kScratchBytes of float32 scratch (L2-sized), so x, re-read once per unit, streams less often.
constexpr int64_t kScratchBytes = 256 << 10;
inline int64_t Group(int64_t rows, int64_t k) {
  if (rows <= kFusedRows) return kGroup;
  const int64_t fit = kScratchBytes / (k * static_cast<int64_t>(sizeof(float)));
  return std::max(kGroup, std::min<int64_t>(8 * kGroup, fit / kTile * kTile));
}

// Unit u: W rows [u * group, ...) against all M rows of x: fused for a decode round, else
// decoded once into the scratch and run x row tile by x row tile (a tile's x rows stay in L1
// over the group's W tiles).
template <Format F>
void Unit(const float* x, const void* w, const uint16_t* d, const uint16_t* m, float* y,
          int64_t rows, int64_t k, int64_t n, int64_t group, int64_t u) {
  const int64_t first = u * group;
  const int64_t count = std::min(group, n - first);
  if (rows <= kFusedRows) {  // a decode round: each block decoded once, into registers
    const int64_t width = Fused<F>::Width(rows);
    for (int64_t c = 0; c < count; c += width) {
      const int64_t tc = std::min(width, count - c);
      Fused<F>::kTiles[rows - 1][tc - 1](x, k, w, d, m, first + c, y, n);
    }
    return;
  }
  // 64-byte aligned: a 16-lane load that splits a cache line costs two.
  thread_local std::unique_ptr<float, decltype(&std::free)> scratch(nullptr, &std::free);
  thread_local int64_t capacity = 0;
  if (capacity < group * k) {
    scratch.reset(static_cast<float*>(std::aligned_alloc(64, group * k * sizeof(float))));
    if (!scratch) throw std::bad_alloc();
    capacity = group * k;
  }
  for (int64_t c = 0; c < count; ++c) DecodeRow<F>(w, d, m, first + c, k, scratch.get() + c * k);
  for (int64_t r = 0; r < rows; r += kLongRows) {
    const int64_t tr = std::min(kLongRows, rows - r);
    for (int64_t c = 0; c < count; c += kTile) {
      const int64_t tc = std::min(kTile, count - c);
      kTiles[tr - 1][tc - 1](x + r * k, k, scratch.get() + c * k, y + r * n + first + c, n);
    }
  }
}

// Shared by every format's handler: checks, the layer's planes, the parallel loop.
// `per_row` is the plane's elements per weight row ([L, N, per_row] once flattened).
template <Format F>
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, const void* w_base,
               ffi::Span<const int64_t> wd, int64_t w_item, const uint16_t* d_base,
               const uint16_t* m_base, ffi::Buffer<ffi::S32>& layer,
               ffi::ResultBuffer<ffi::F32>& y) {
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || wd.size() < 3 || yd[0] != xd[0] ||
      yd[1] != wd[1] || layer.element_count() != 1 || xd[1] % kBlock != 0) {
    return ffi::Error::InvalidArgument(
        "kipp_cpu_stored_matmul: expected x [M, K] float32 with K a multiple of 32, w "
        "[L, N, ...], y [M, N], layer [1] int32");
  }
  const int64_t k = xd[1], n = wd[1], rows = xd[0], blocks = k / kBlock;
  int64_t per_row = 1;
  for (size_t i = 2; i < wd.size(); ++i) per_row *= wd[i];
  const int64_t want = F == Format::kBf16 ? k : F == Format::kQ8_0 ? k : blocks * 16;
  if (per_row != want) {
    return ffi::Error::InvalidArgument("kipp_cpu_stored_matmul: weight row size != K");
  }
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= wd[0]) {
    return ffi::Error::InvalidArgument("kipp_cpu_stored_matmul: layer out of range");
  }
  const void* wp = static_cast<const char*>(w_base) + index * n * per_row * w_item;
  const uint16_t* dp = d_base ? d_base + index * n * blocks : nullptr;
  const uint16_t* mp = m_base ? m_base + index * n * blocks : nullptr;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  if (rows == 0) return ffi::Error::Success();
  const int64_t group = Group(rows, k);
  const int64_t units = (n + group - 1) / group;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  kipp::ParallelFor(pool, units, units / (threads * 8), [=](int64_t u) {
    Unit<F>(xp, wp, dp, mp, yp, rows, k, n, group, u);
  });
  return ffi::Error::Success();
}

// 16-bit floats (BF16 weights, fp16 scales) arrive as their own XLA type or as uint16 bits.
bool Is16(ffi::AnyBuffer& a, ffi::DataType f) {
  return a.element_type() == f || a.element_type() == ffi::DataType::U16;
}

ffi::Error Bf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  if (!Is16(w, ffi::DataType::BF16)) {
    return ffi::Error::InvalidArgument("kipp_cpu_stored_matmul: bf16 w must be BF16 or uint16");
  }
  return Run<Format::kBf16>(pool, x, w.untyped_data(), w.dimensions(), 2, nullptr, nullptr,
                            layer, y);
}

// The quantized formats: w's element type and the scale planes' shapes checked, then Run.
template <Format F>
ffi::Error Quantized(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                     ffi::AnyBuffer d, ffi::AnyBuffer* m, ffi::Buffer<ffi::S32> layer,
                     ffi::ResultBuffer<ffi::F32> y) {
  const ffi::DataType want = F == Format::kQ8_0 ? ffi::DataType::S8 : ffi::DataType::U8;
  const int64_t per_block = F == Format::kQ8_0 ? kBlock : 16;
  if (w.element_type() != want || !Is16(d, ffi::DataType::F16) ||
      (m && !Is16(*m, ffi::DataType::F16))) {
    return ffi::Error::InvalidArgument(
        "kipp_cpu_stored_matmul: w must be int8 (q8_0) or uint8 nibbles, d and m fp16");
  }
  if (static_cast<int64_t>(d.element_count()) * per_block !=
          static_cast<int64_t>(w.element_count()) ||
      (m && m->element_count() != d.element_count())) {
    return ffi::Error::InvalidArgument(
        "kipp_cpu_stored_matmul: d or m does not match w's blocks");
  }
  return Run<F>(pool, x, w.untyped_data(), w.dimensions(), 1,
                static_cast<const uint16_t*>(d.untyped_data()),
                m ? static_cast<const uint16_t*>(m->untyped_data()) : nullptr, layer, y);
}

ffi::Error Q8_0(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                ffi::AnyBuffer d, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return Quantized<Format::kQ8_0>(pool, x, w, d, nullptr, layer, y);
}

ffi::Error Scale4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                  ffi::AnyBuffer d, ffi::Buffer<ffi::S32> layer,
                  ffi::ResultBuffer<ffi::F32> y) {
  return Quantized<Format::kScale4>(pool, x, w, d, nullptr, layer, y);
}

ffi::Error Affine4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                   ffi::AnyBuffer d, ffi::AnyBuffer m, ffi::Buffer<ffi::S32> layer,
                   ffi::ResultBuffer<ffi::F32> y) {
  return Quantized<Format::kAffine4>(pool, x, w, d, &m, layer, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KippCpuStoredMatmulBf16, Bf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w: BF16 (or its bits)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

// q8_0 and scale4_gs32 take the same buffers: x, w (int8 q or uint8 nibbles), d (fp16 or its
// bits), layer -> y.
static auto ScaledBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(KippCpuStoredMatmulQ8_0, Q8_0, ScaledBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(KippCpuStoredMatmulScale4, Scale4, ScaledBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(KippCpuStoredMatmulAffine4, Affine4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w: uint8 nibbles
                                  .Arg<ffi::AnyBuffer>()  // d: fp16 (or its bits)
                                  .Arg<ffi::AnyBuffer>()  // m: fp16 (or its bits)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
