// Kipp's CPU matmul over the artifact's stored weights: y[M, N] = x[M, K] @ W^T with W as the
// "device" layout holds it (kipp/cuda/layout.py), never a float32 copy: BF16 bits [N, K],
// q8_0 int8 [N, K/32, 32] + fp16 d [N, K/32], scale4_gs32 (Q4_0) and affine4_gs32 (Q4_1)
// nibbles [N, K/32, 16] + d (+ m), all stacked over layers [L, ...] and read at `layer`.
//
// A work unit is kGroup output rows of W. Each 32-weight block is decoded exactly as
// kipp/formats/quant.py does (bits << 16; d * q; d * (q - 8); d * q + m), with AVX-512 where
// the build has it (kipp/cuda/cpu/matmul.py builds for the set the CPU reports at load; the
// 4-bit formats as a 16-entry table per block, looked up per nibble), AVX2 + FMA in the build
// for that set (stored_avx2.h: the same operations in 8-float halves), plain C++ otherwise;
// in the build for CPUs with AMX tiles, BF16 weights meet x on the tile unit (stored_amx.h,
// its own numerics, described there).
// A decode round (up to 8 rows of x) decodes each block into registers and multiplies all its
// rows against it, W tiles of 1 or 2 rows (BF16, q8_0) or up to 4 (the 4-bit tables), over
// spans of K whose x rows stay in L1, with the W bytes the unit reads next prefetched into L2
// (BF16 rounds of up to 32 rows run so too outside the AVX2 build, 8 x rows at a time);
// a longer round's unit is as many W rows as fill an L2-sized float32 scratch
// (16 to 128), decoded once and run against the x rows in tiles of up to 6 x rows by 4 W rows.
// Either way each x vector is held in a register across its tile's W rows (loads, not FMAs,
// bounded the narrower tiles) and each stored byte is read from memory once.
//
// Numerics: each output y[m][n] is a 16-lane fused multiply-add chain over k (lane j sums
// k = j, j + 16, ...), in k order, then one fixed add tree over the lanes: the same operations
// whatever the tile, the row count or the thread split, so a row's result is bitwise the same
// alone or batched. The activation stays float32 (no int8 rounding): only the summation order
// differs from the float64 oracle. The int8 dot (Dot::kInt8, stored_int8.h) rounds x to int8
// per block first, the BF16 dot (Dot::kBf16, below) to bf16: their own numerics, every row
// count alike.
#include <limits>

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

// The lanes' sum in one fixed tree: (0 + 8), then + 4, + 2, + 1 apart. AVX-512 and AVX2 add
// the same pairs in vector halves (the same bits: each add is the same two floats).
inline float Sum16(v16 v) {
#if defined(__AVX512F__)
  const __m512 z = reinterpret_cast<__m512>(v);
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(z),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
#elif defined(__AVX2__)
  __m256 lo, hi;
  std::memcpy(&lo, &v, 32), std::memcpy(&hi, reinterpret_cast<const char*>(&v) + 32, 32);
  const __m256 a = _mm256_add_ps(lo, hi);
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

constexpr int64_t kScaleRun = 16;  // blocks whose scales a narrow decode tile converts at once

#if defined(__AVX512F__)
// *h as float32 in every lane: one broadcast and one conversion (Half's exact value).
inline __m512 HalfBroadcast(const uint16_t* h) {
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(*h)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// A 4-bit block [16 bytes of nibbles] as float32 from its table (each entry quant.py's
// arithmetic on that nibble, so the same bits), looked up per nibble: vpermps reads only an
// index's low 4 bits, so the low nibbles need no mask. `scale`, `low`: d (and affine4's m) in
// every lane.
template <Format F>
inline void DecodeNibbles(const uint8_t* q, __m512 scale, __m512 low, v16* lo, v16* hi) {
  const __m512i wide =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  __m512 table;
  if constexpr (F == Format::kScale4) {  // d * (q - 8)
    (void)low;
    table = _mm512_mul_ps(scale, _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4,
                                                5, 6, 7));
  } else {  // d * q + m
    table = _mm512_add_ps(_mm512_mul_ps(scale, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                              11, 12, 13, 14, 15)),
                          low);
  }
  *lo = reinterpret_cast<v16>(_mm512_permutexvar_ps(wide, table));
  *hi = reinterpret_cast<v16>(_mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), table));
}

// 16 int8 of a q8_0 block as float32, d * q (exact): `scale` is d in every lane. A tile that
// uses one half of a block at a time decodes only that half.
inline v16 DecodeQ8Half(const int8_t* q, __m512 scale) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m512 q32 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  return reinterpret_cast<v16>(_mm512_mul_ps(scale, q32));
}

// A decode tile's scales (and affine4's m) kScaleRun blocks at a time, converted to float32 in
// one instruction per row (Half's exact values): each block's multiply then broadcasts its
// scale from memory, where a broadcast and a conversion per block took two of the shuffles
// that bound the narrow quantized tiles.
inline void HalfRun(const uint16_t* h, int64_t count, float* out) {
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, h)));
}
#define KIPP_SCALE_RUNS 1
#endif

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
    const __m512 scale = HalfBroadcast(d + at);
    *lo = DecodeQ8Half(q, scale);
    *hi = DecodeQ8Half(q + kLanes, scale);
  } else {
    const __m512 low = F == Format::kAffine4 ? HalfBroadcast(m + at) : _mm512_setzero_ps();
    DecodeNibbles<F>(static_cast<const uint8_t*>(w) + at * 16, HalfBroadcast(d + at), low, lo,
                     hi);
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

// A decode round's tiles read W rows n0 .. n0 + C - 1 side by side, in spans of K (SpanBlocks):
// short interleaved streams, which the hardware prefetcher follows poorly. So each block step
// asks for the same block of the tile kPrefetchTiles tiles ahead, which the unit reads next in
// the same span (past the unit's last tile: the next unit's first tiles, read after this
// unit's spans). The lines go to L2, not L1: a prefetch into L1 holds one of L1's few miss
// buffers until its line arrives, so a round of several x rows, busy with its FMAs, left the
// stream short of them. A prefetch past a plane's end does not fault.
constexpr int kPrefetchTiles = 4;

// Block step b of the tile whose first W row is `ahead`, C rows wide: each row's line holding
// block b when the block starts one (the planes' rows start on a line at the shapes Kipp runs;
// elsewhere a block's tail is fetched with the next line's), its weights and its scales.
template <Format F, int C>
inline void PrefetchAhead(const void* w, const uint16_t* d, const uint16_t* m, int64_t ahead,
                          int64_t b, int64_t blocks) {
  constexpr int64_t kBytes = F == Format::kBf16 ? 64 : F == Format::kQ8_0 ? 32 : 16;
  constexpr int64_t kScales = 64 / sizeof(uint16_t);  // blocks per line of d or m
  for (int c = 0; c < C; ++c) {
    const int64_t at = (ahead + c) * blocks + b;  // in blocks, from the plane's start
    const char* bytes = static_cast<const char*>(w) + at * kBytes;
    if (b % (64 / kBytes) == 0) __builtin_prefetch(bytes, 0, 2);
    if (F != Format::kBf16 && b % kScales == 0) {
      __builtin_prefetch(d + at, 0, 2);
      if (F == Format::kAffine4) __builtin_prefetch(m + at, 0, 2);
    }
  }
}

// Whether a block's two halves come out of one decode (the 4-bit table), so both are kept.
template <Format F>
constexpr bool kSharedHalves = F == Format::kScale4 || F == Format::kAffine4;

// R rows of x (a decode round) against W rows n0 .. n0 + C - 1 decoded block by block into
// registers, half a block (16 weights) at a time: the same FMA chains as Tile over a decoded
// scratch, without the scratch. Each x vector is held in a register across the tile's C W rows.
// The tile runs blocks [b0, b1) of the row (a span of K, kept in L1 across a unit's tiles; see
// SpanBlocks): its chains start from `carry` (R x C vectors) unless b0 is the first block, and
// end in `carry` unless b1 is past the last, where y takes their sums. A chain parked in memory
// and picked up again is the same chain: spans change no output's bits.
template <Format F, int R, int C>
void FusedTile(const float* x, int64_t k, const void* w, const uint16_t* d, const uint16_t* m,
               int64_t n0, int64_t b0, int64_t b1, v16* carry, float* y, int64_t ldy) {
  const int64_t blocks = k / kBlock;
  v16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = b0 == 0 ? Broadcast16(0.0f) : carry[r * C + c];
#if defined(KIPP_SCALE_RUNS)
  // the scale runs pay in the narrow rounds, where the decode's shuffles bound the tile (the
  // 4-bit tables; q8_0's widening of every block's bytes, at one x row); a wider round's
  // accumulators leave no registers for them
  constexpr bool kRuns = (kSharedHalves<F> && R <= 2) || (F == Format::kQ8_0 && R == 1);
  float ds[kRuns ? C : 1][kScaleRun], ms[kRuns && F == Format::kAffine4 ? C : 1][kScaleRun];
#endif
  for (int64_t b = b0; b < b1; ++b) {
    // A BF16 tile of one x row reads one W row: a thread's one sequential stream, which the
    // hardware prefetcher follows and the prefetches only slowed (from two x rows they pay)
    if constexpr (F != Format::kBf16 || R > 1) {
      PrefetchAhead<F, C>(w, d, m, n0 + kPrefetchTiles * C, b, blocks);
    }
#if defined(KIPP_SCALE_RUNS)
    if (kRuns && b % kScaleRun == 0) {  // spans start at multiples of kScaleRun blocks
      const int64_t run = std::min(kScaleRun, blocks - b);
      for (int c = 0; c < C; ++c) {
        HalfRun(d + (n0 + c) * blocks + b, run, ds[c]);
        if constexpr (F == Format::kAffine4) HalfRun(m + (n0 + c) * blocks + b, run, ms[c]);
      }
    }
#endif
    v16 half[2][C];
    for (int h = 0; h < 2; ++h) {
      // BF16 and q8_0 decode each half on its own; a 4-bit block's halves share its table
      if (h == 0 || !kSharedHalves<F>) {
        for (int c = 0; c < C; ++c) {
          v16 lo, hi;
#if defined(KIPP_SCALE_RUNS)
          if constexpr (kRuns && F == Format::kQ8_0) {
            lo = hi = DecodeQ8Half(
                static_cast<const int8_t*>(w) + ((n0 + c) * blocks + b) * kBlock + kLanes * h,
                _mm512_set1_ps(ds[c][b % kScaleRun]));
          } else if constexpr (kRuns) {
            const __m512 low = F == Format::kAffine4 ? _mm512_set1_ps(ms[c][b % kScaleRun])
                                                      : _mm512_setzero_ps();
            DecodeNibbles<F>(static_cast<const uint8_t*>(w) + ((n0 + c) * blocks + b) * 16,
                             _mm512_set1_ps(ds[c][b % kScaleRun]), low, &lo, &hi);
          } else {
            DecodeBlock<F>(w, d, m, n0 + c, b, blocks, &lo, &hi);
          }
#else
          DecodeBlock<F>(w, d, m, n0 + c, b, blocks, &lo, &hi);
#endif
          half[h][c] = h ? hi : lo;
          if (kSharedHalves<F>) half[1][c] = hi;
        }
      }
      for (int r = 0; r < R; ++r) {
        v16 xv = Load16(x + r * k + b * kBlock + kLanes * h);
        Pin(xv);
        for (int c = 0; c < C; ++c) acc[r][c] = Fma16(xv, half[h][c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      if (b1 < blocks) {
        carry[r * C + c] = acc[r][c];
      } else {
        y[r * ldy + n0 + c] = Sum16(acc[r][c]);
      }
    }
}

// A decode round (up to kFusedRows rows) runs all its x rows against each tile of W rows, so
// each block is decoded once.
constexpr int kFusedRows = 8;
// The most rows a round of format F runs as decode rounds of kFusedRows rows over each unit's
// W rows (read again from L1 or L2 per round), not through the float32 scratch. BF16's decode
// is a shift: up to 32 rows, decoding it into the scratch cost more than the reads it saves.
// The AVX2 build's rounds (stored_avx2.h) keep 8: its 24- and 32-row rounds ran slower so.
template <Format F>
constexpr int64_t FusedLimit() {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return kFusedRows;
#else
  return F == Format::kBf16 ? 4 * kFusedRows : kFusedRows;
#endif
}
// W rows a tile of R x rows takes at most. BF16 and q8_0: two (DecodeWidth). A 4-bit tile,
// its two decoded halves a W row beside them: at most 4 W rows and 30 registers (wider ones
// spill).
constexpr int kFusedCols = 4;
template <Format F>
constexpr int FusedWidth(int rows) {
  return kSharedHalves<F> ? std::min(4, 30 / (rows + 2)) : 2;
}
// W rows a decode round's tiles take. BF16 takes one W row at a time for up to kStreamRows x
// rows (a row's decode is cheap next to its bytes); a round of more x rows takes two, whose
// FMAs would otherwise wait on each chain's latency (from 4 rows: at 3, two ran no faster).
// q8_0, whose decode costs more, takes two at every row count, so two decodes overlap. The
// 4-bit tiles, bound by their table decode, take FusedWidth. Which W rows share a tile changes
// no output's chain.
constexpr int64_t kStreamRows = 3;
template <Format F>
constexpr int64_t DecodeWidth(int64_t rows) {
  return F == Format::kBf16 && rows <= kStreamRows ? 1 : FusedWidth<F>(rows);
}
// Blocks of K a decode round's tiles take at a time. A round whose x rows fit L1 (kL1Bytes)
// takes whole rows. A wider one takes spans of x of at most kSpanBytes, so a span stays in L1
// across the unit's W rows, where whole rows (four at K = 3072 are 48 KB) would be read again
// from L2 for every W row. Rows that fit are not split: a span's end parks every chain and
// breaks the W stream for nothing. A span is a multiple of kScaleRun blocks.
constexpr int64_t kL1Bytes = 32 << 10, kSpanBytes = 16 << 10;
inline int64_t SpanBlocks(int64_t rows, int64_t blocks, int64_t x_bytes = sizeof(float)) {
  const int64_t block_bytes = rows * kBlock * x_bytes;
  if (blocks * block_bytes <= kL1Bytes) return blocks;
  return std::max(kScaleRun, kSpanBytes / block_bytes / kScaleRun * kScaleRun);
}

// A decode round's tile as the tables hold it (stored_avx2.h has its own, in 8-float halves).
using SpanFn = void (*)(const float*, int64_t, const void*, const uint16_t*, const uint16_t*,
                        int64_t, int64_t, int64_t, v16*, float*, int64_t);
// The tiles a round uses, R x rows by C W rows (nullptr for shapes no round makes).
template <Format F, int R, int C>
constexpr SpanFn FusedPick() {
  if constexpr (C <= FusedWidth<F>(R)) return FusedTile<F, R, C>;
  return nullptr;
}
template <Format F, int R>
struct FusedRow {
  static constexpr SpanFn kTiles[kFusedCols] = {
      FusedPick<F, R, 1>(), FusedPick<F, R, 2>(), FusedPick<F, R, 3>(), FusedPick<F, R, 4>()};
};
template <Format F>
struct Fused {
  static constexpr const SpanFn* kTiles[kFusedRows] = {
      FusedRow<F, 1>::kTiles, FusedRow<F, 2>::kTiles, FusedRow<F, 3>::kTiles,
      FusedRow<F, 4>::kTiles, FusedRow<F, 5>::kTiles, FusedRow<F, 6>::kTiles,
      FusedRow<F, 7>::kTiles, FusedRow<F, 8>::kTiles};
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
// kScratchBytes (L2-sized) at `w_bytes` a weight (the float32 scratch's 4; the BF16 dot's rows,
// read in place, 2), so x, re-read once per unit, streams less often.
constexpr int64_t kScratchBytes = 256 << 10;
inline int64_t Group(int64_t rows, int64_t k, int64_t w_bytes = sizeof(float)) {
  if (rows <= kFusedRows) return kGroup;
  const int64_t fit = kScratchBytes / (k * w_bytes);
  return std::max(kGroup, std::min<int64_t>(8 * kGroup, fit / kTile * kTile));
}

// This thread's float32 scratch of at least `floats`, 64-byte aligned (a 16-lane load that
// splits a cache line costs two).
inline float* Scratch(int64_t floats) {
  thread_local std::unique_ptr<float, decltype(&std::free)> scratch(nullptr, &std::free);
  thread_local int64_t capacity = 0;
  if (capacity < floats) {
    scratch.reset(static_cast<float*>(std::aligned_alloc(64, floats * sizeof(float))));
    if (!scratch) throw std::bad_alloc();
    capacity = floats;
  }
  return scratch.get();
}

// Unit u: W rows [u * group, ...) against all M rows of x: fused for a decode round, else
// decoded once into the scratch and run x row tile by x row tile (a tile's x rows stay in L1
// over the group's W tiles).
template <Format F>
void Unit(const float* x, const void* w, const uint16_t* d, const uint16_t* m, float* y,
          int64_t rows, int64_t k, int64_t n, int64_t group, int64_t u) {
  const int64_t first = u * group;
  const int64_t count = std::min(group, n - first);
  if (rows <= FusedLimit<F>()) {  // decode rounds: each block decoded into registers
    for (int64_t r0 = 0; r0 < rows; r0 += kFusedRows) {
      const int64_t tr = std::min<int64_t>(kFusedRows, rows - r0);
      const int64_t width = DecodeWidth<F>(tr), blocks = k / kBlock;
      const int64_t span = SpanBlocks(tr, blocks);
      alignas(64) v16 carry[kGroup * kFusedRows];  // tile c's chains at carry + c * tr
      for (int64_t b0 = 0; b0 < blocks; b0 += span) {
        const int64_t b1 = std::min(blocks, b0 + span);
        for (int64_t c = 0; c < count; c += width) {
          const int64_t tc = std::min(width, count - c);
          Fused<F>::kTiles[tr - 1][tc - 1](x + r0 * k, k, w, d, m, first + c, b0, b1,
                                           carry + c * tr, y + r0 * n, n);
        }
      }
    }
    return;
  }
  float* scratch = Scratch(group * k);
  for (int64_t c = 0; c < count; ++c) DecodeRow<F>(w, d, m, first + c, k, scratch + c * k);
  for (int64_t r = 0; r < rows; r += kLongRows) {
    const int64_t tr = std::min(kLongRows, rows - r);
    for (int64_t c = 0; c < count; c += kTile) {
      const int64_t tc = std::min(kTile, count - c);
      kTiles[tr - 1][tc - 1](x + r * k, k, scratch + c * k, y + r * n + first + c, n);
    }
  }
}

// The int8 dot (Dot::kInt8): the activation quantized to int8 per block (stored_int8.h).
enum class Dot { kF32, kInt8, kBf16 };

#include "stored_int8.h"  // every build's int8 dot

// ---- The BF16 dot (Dot::kBf16): BF16 weights against x rounded to bf16 ----
// As a GPU's tensor cores (and llama.cpp's BF16 dot) do it: each row of x rounded to bf16 once
// a call (to nearest, ties to even: ml_dtypes' rounding), then vdpbf16ps multiplies 32 bf16
// pairs into 16 float32 lanes, twice the multiply-adds of a float32 FMA per instruction, the
// weights read in place with nothing to decode. Output y[m][n] is one 16-lane chain over k
// (lane j adds the exact products at k = 32 i + 2 j + 1, then 32 i + 2 j, each add rounded,
// subnormals read and written as zero; in i order), then Sum16: the same operations
// whatever the tile, the row count or the thread split, so a row is bitwise the same alone or
// batched. Built where the build has AVX-512 (the instructions compiled for AVX-512 BF16 alone)
// and run only where the CPU reports AVX-512 BF16 (checked per call).
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KIPP_BF16_DOT 1
#define KIPP_BF16_TARGET __attribute__((target("avx512bf16")))

// x [count] -> bf16 bits, to nearest even (a NaN stays a quiet NaN), 16 at a time (count a
// multiple of 16: K is of 32). Not vcvtne2ps2bf16: it flushes subnormals, which ml_dtypes'
// rounding keeps (vdpbf16ps then reads them as zero).
inline void RoundBf16Row(const float* x, int64_t count, uint16_t* out) {
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
  for (int64_t i = 0; i < count; i += 16) {
    const __m512i u = _mm512_loadu_si512(x + i);
    const __m512i top = _mm512_srli_epi32(u, 16);
    const __m512i even = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(top, one))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, magnitude), inf);
    const __m512i bits = _mm512_mask_or_epi32(even, nan, top, _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(bits));
  }
}

inline void PinI(__m512i& v) { asm("" : "+v"(v)); }

// Whether a tile of R x rows prefetches the W rows ahead (PrefetchAhead). One or two rows' short
// loop bodies ran slower with it than on the hardware prefetcher alone (one sequential stream
// a thread); from three rows, slower without it.
constexpr bool Bf16DotPrefetch(int rows) { return rows > 2; }

// R rows of bf16 x against W rows n0 .. n0 + C - 1, blocks [b0, b1) of K, chains carried across
// spans as FusedTile's: each W vector (32 weights) and each x vector held in a register across
// the tile.
template <int R, int C>
KIPP_BF16_TARGET void Bf16DotTile(const uint16_t* x, int64_t k, const uint16_t* w, int64_t n0,
                                  int64_t b0, int64_t b1, v16* carry, float* y, int64_t ldy) {
  const int64_t blocks = k / kBlock;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = b0 == 0 ? _mm512_setzero_ps() : reinterpret_cast<__m512>(carry[r * C + c]);
  for (int64_t b = b0; b < b1; ++b) {
    if constexpr (Bf16DotPrefetch(R)) {
      PrefetchAhead<Format::kBf16, C>(w, nullptr, nullptr, n0 + kPrefetchTiles * C, b, blocks);
    }
    __m512i wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + ((n0 + c) * blocks + b) * kBlock);
    for (int r = 0; r < R; ++r) {
      __m512i xv = _mm512_loadu_si512(x + r * k + b * kBlock);
      PinI(xv);
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], reinterpret_cast<__m512bh>(xv),
                                     reinterpret_cast<__m512bh>(wv[c]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      if (b1 < blocks) {
        carry[r * C + c] = reinterpret_cast<v16>(acc[r][c]);
      } else {
        y[r * ldy + n0 + c] = Sum16(reinterpret_cast<v16>(acc[r][c]));
      }
    }
}

// Tiles of R x rows by C W rows: R * C chains, C weight vectors and one x vector in AVX-512's
// 32 registers (nullptr for shapes that would spill).
constexpr int Bf16DotWidth(int rows) { return std::min(4, 30 / (rows + 1)); }
using Bf16DotFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t,
                           v16*, float*, int64_t);
template <int R, int C>
constexpr Bf16DotFn Bf16DotPick() {
  if constexpr (C <= Bf16DotWidth(R)) return Bf16DotTile<R, C>;
  return nullptr;
}
template <int R>
struct Bf16DotRow {
  static constexpr Bf16DotFn kTiles[kFusedCols] = {Bf16DotPick<R, 1>(), Bf16DotPick<R, 2>(),
                                                   Bf16DotPick<R, 3>(), Bf16DotPick<R, 4>()};
};
constexpr const Bf16DotFn* kBf16DotTiles[kFusedRows] = {
    Bf16DotRow<1>::kTiles, Bf16DotRow<2>::kTiles, Bf16DotRow<3>::kTiles, Bf16DotRow<4>::kTiles,
    Bf16DotRow<5>::kTiles, Bf16DotRow<6>::kTiles, Bf16DotRow<7>::kTiles, Bf16DotRow<8>::kTiles};

// W rows a decode round's tile takes: one up to 4 x rows (wider tiles' interleaved streams ran
// slower: vdpbf16ps leaves a short loop body), else two, whose dots would otherwise wait on
// each chain's latency (wider ones ran slower again).
constexpr int64_t kBf16StreamRows = 4;
constexpr int64_t Bf16DecodeWidth(int64_t rows) { return rows <= kBf16StreamRows ? 1 : 2; }
constexpr int64_t kBf16LongRows = 6;  // a long round's x rows per tile (by 4 W rows)

// Unit u of the BF16 dot: W rows [u * group, ...) against every bf16 x row. A decode round (up
// to kFusedRows rows) is one x tile over spans of K that keep its rows in L1; a longer round
// runs tiles of 6 x rows by 4 W rows over whole rows, the group's W rows (L2-sized) re-read
// from L2 by each x tile.
KIPP_BF16_TARGET void Bf16DotUnit(const uint16_t* x, const uint16_t* w, float* y, int64_t rows,
                                  int64_t k, int64_t n, int64_t group, int64_t u) {
  const int64_t first = u * group, count = std::min(group, n - first), blocks = k / kBlock;
  if (rows <= kFusedRows) {
    const int64_t width = Bf16DecodeWidth(rows);
    const int64_t span = SpanBlocks(rows, blocks, sizeof(uint16_t));
    alignas(64) v16 carry[kGroup * kFusedRows];
    for (int64_t b0 = 0; b0 < blocks; b0 += span) {
      const int64_t b1 = std::min(blocks, b0 + span);
      for (int64_t c = 0; c < count; c += width) {
        const int64_t tc = std::min(width, count - c);
        kBf16DotTiles[rows - 1][tc - 1](x, k, w, first + c, b0, b1, carry + c * rows, y, n);
      }
    }
    return;
  }
  for (int64_t r = 0; r < rows; r += kBf16LongRows) {
    const int64_t tr = std::min(kBf16LongRows, rows - r);
    for (int64_t c = 0; c < count; c += kTile) {
      const int64_t tc = std::min(kTile, count - c);
      kBf16DotTiles[tr - 1][tc - 1](x + r * k, k, w, first + c, 0, blocks, nullptr,
                                    y + r * n, n);
    }
  }
}

inline bool HasBf16Dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KIPP_AVX2 1
#include "stored_avx2.h"  // this build's Unit and QUnit, in 8-float halves
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define KIPP_AMX 1
#include "stored_amx.h"  // this build's BF16 dot, on the tile unit
#endif

// Shared by every format's handler: checks, the layer's planes, the parallel loop.
// `per_row` is the plane's elements per weight row ([L, N, per_row] once flattened).
template <Format F, Dot D = Dot::kF32>
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
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if constexpr (D == Dot::kBf16) {
    static_assert(F == Format::kBf16, "the BF16 dot reads BF16 weights");
#if defined(KIPP_BF16_DOT)
    if (HasBf16Dot()) {
      std::unique_ptr<uint16_t, decltype(&std::free)> xs(
          static_cast<uint16_t*>(std::aligned_alloc(64, rows * k * sizeof(uint16_t))),
          &std::free);
      if (!xs) throw std::bad_alloc();
      RoundBf16Row(xp, rows * k, xs.get());
      const uint16_t *xsp = xs.get(), *w16 = static_cast<const uint16_t*>(wp);
      const int64_t group = Group(rows, k, sizeof(uint16_t)), units = (n + group - 1) / group;
      kipp::ParallelFor(pool, units, units / (threads * 8), [=](int64_t u) {
        Bf16DotUnit(xsp, w16, yp, rows, k, n, group, u);
      });
      return ffi::Error::Success();
    }
#endif
    return ffi::Error::Internal(
        "kipp_cpu_stored_matmul: the bf16 dot needs a CPU with AVX-512 BF16 (KIPP_JAX_CPU_DOT)");
  }
  if constexpr (D == Dot::kInt8) {
    const int64_t spans = (blocks + int8::kSpan - 1) / int8::kSpan;
    std::unique_ptr<int8::QSpan, decltype(&std::free)> q(
        static_cast<int8::QSpan*>(std::aligned_alloc(64, rows * spans * sizeof(int8::QSpan))),
        &std::free);
    if (!q) throw std::bad_alloc();
    int8::QSpan* qp = q.get();
    kipp::ParallelFor(pool, rows, std::max<int64_t>(1, rows / (threads * 4)), [=](int64_t r) {
      int8::QuantizeRow<F>(xp + r * k, k, qp + r * spans);
    });
    // a long round's units are wider: each re-reads its W rows (from L2) per tile of x rows
    const int64_t group = rows <= int8::kRows ? kGroup : 4 * kGroup;
    const int64_t units = (n + group - 1) / group;
    kipp::ParallelFor(pool, units, units / (threads * 8), [=](int64_t u) {
      int8::Unit<F>(qp, wp, dp, mp, yp, rows, k, n, group, u);
    });
    return ffi::Error::Success();
  }
#if defined(KIPP_AMX)
  if constexpr (F == Format::kBf16) {
    if (!amx::Permitted()) {
      return ffi::Error::Internal(
          "kipp_cpu_stored_matmul: Linux refused this process AMX tile state (arch_prctl)");
    }
    const int64_t groups = (rows + amx::kRows - 1) / amx::kRows;
    std::unique_ptr<uint16_t, decltype(&std::free)> xs(
        static_cast<uint16_t*>(std::aligned_alloc(
            64, groups * blocks * amx::kParts * amx::kTileHalves * sizeof(uint16_t))),
        &std::free);
    if (!xs) throw std::bad_alloc();
    uint16_t* xsp = xs.get();
    kipp::ParallelFor(pool, groups, 1, [=](int64_t g) { amx::Prepare(xp, rows, k, g, xsp); });
    const uint16_t* w16 = static_cast<const uint16_t*>(wp);
    const int64_t group = amx::Group(rows), units = (n + group - 1) / group;
    kipp::ParallelFor(pool, units, units / (threads * 8), [=](int64_t u) {
      amx::Unit(xsp, w16, yp, rows, k, n, group, u);
    });
    return ffi::Error::Success();
  }
#endif
  const int64_t group = rows <= FusedLimit<F>() ? kGroup : Group(rows, k);
  const int64_t units = (n + group - 1) / group;
  kipp::ParallelFor(pool, units, units / (threads * 8), [=](int64_t u) {
#if defined(KIPP_AVX2)
    avx2::Unit<F>(xp, wp, dp, mp, yp, rows, k, n, group, u);
#else
    Unit<F>(xp, wp, dp, mp, yp, rows, k, n, group, u);
#endif
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
template <Format F, Dot D = Dot::kF32>
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
  return Run<F, D>(pool, x, w.untyped_data(), w.dimensions(), 1,
                static_cast<const uint16_t*>(d.untyped_data()),
                m ? static_cast<const uint16_t*>(m->untyped_data()) : nullptr, layer, y);
}

ffi::Error Bf16Bf16Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                       ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  if (!Is16(w, ffi::DataType::BF16)) {
    return ffi::Error::InvalidArgument("kipp_cpu_stored_matmul: bf16 w must be BF16 or uint16");
  }
  return Run<Format::kBf16, Dot::kBf16>(pool, x, w.untyped_data(), w.dimensions(), 2, nullptr,
                                        nullptr, layer, y);
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

ffi::Error Q8_0Int8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                    ffi::AnyBuffer d, ffi::Buffer<ffi::S32> layer,
                    ffi::ResultBuffer<ffi::F32> y) {
  return Quantized<Format::kQ8_0, Dot::kInt8>(pool, x, w, d, nullptr, layer, y);
}

ffi::Error Scale4Int8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::AnyBuffer d, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> y) {
  return Quantized<Format::kScale4, Dot::kInt8>(pool, x, w, d, nullptr, layer, y);
}

ffi::Error Affine4Int8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                       ffi::AnyBuffer d, ffi::AnyBuffer m, ffi::Buffer<ffi::S32> layer,
                       ffi::ResultBuffer<ffi::F32> y) {
  return Quantized<Format::kAffine4, Dot::kInt8>(pool, x, w, d, &m, layer, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KippCpuStoredMatmulBf16, Bf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w: BF16 (or its bits)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(KippCpuStoredMatmulBf16Bf16Dot, Bf16Bf16Dot,
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(KippCpuStoredMatmulQ8_0Int8, Q8_0Int8, ScaledBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(KippCpuStoredMatmulScale4Int8, Scale4Int8, ScaledBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(KippCpuStoredMatmulAffine4, Affine4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w: uint8 nibbles
                                  .Arg<ffi::AnyBuffer>()  // d: fp16 (or its bits)
                                  .Arg<ffi::AnyBuffer>()  // m: fp16 (or its bits)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(KippCpuStoredMatmulAffine4Int8, Affine4Int8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
