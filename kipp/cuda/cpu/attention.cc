// Kipp's CPU attention for the JAX backend over the paged BF16 KV slab, XLA FFI handlers
// (kipp/cuda/cpu/attention.py): one query per sequence (a decode round) or several (a prefill
// chunk, or a round mixing chunks and decode rows).
//
// The step has already stored this round's rows in the slab (its own in-place scatter); the
// handlers only read it:
// out[s, t, h] = softmax_p(q[s, t, h] . K[s, p, h / group] * 128^-0.5) . V[s, p, h / group]
// over the positions p = 0..pos[s, t] of sequence s, position p read at slab row
// tables[s, p / 32] * 32 + p % 32 (a block outside the slab clamped into it: the backend's
// checks keep tables inside it, so this only bounds the reads), from
// layer `layer` of a slab [layers, blocks, 32, 8, 128] of BF16 bit patterns (uint16). A
// query with pos < 0 (a padding row) gets zeros.
//
// Why: the jax.numpy twin gathers each sequence's rows, widens and (for the grouped form)
// transposes them before batched dots over every position, masked or not: an 8-sequence decode
// step grew with context on XLA's CPU (bench/results/*-batch_scaling-*), and a prefill chunk's
// attention cost more than its matmuls. Here each unit of work, one sequence, one KV head and
// up to 32 queries, widens the K and V rows its queries see, a chunk at a time, once for all
// the query heads that share them: scores, then each query's softmax, then the weighted sum of
// V rows. A decode round whose units can be a sequence and 4 or 8 KV heads, every thread
// given one, takes those instead (DecodeUnit), reading each position's heads as one span.
// Float32 throughout; each dot is two chains of 8 eight-wide fused multiply-adds (even and odd
// vectors, one 16-wide chain of both in AVX-512 builds) then a fixed pairwise sum (four dots'
// sums at once, as vector adds of the same pairs, in a prefill unit of the AVX-512 builds and
// in both units of the AVX2 build, whose dots run four positions side by side), so a query's
// result depends neither on the other queries and sequences in the round, nor on the unit,
// nor on the thread split.
#include <string>
#include <vector>

#include "kernels.h"

namespace {

using kipp::Broadcast;
using kipp::Fma;
using kipp::Load;
using kipp::Store;
using kipp::v8;
namespace ffi = xla::ffi;

constexpr int64_t kHeadDim = 128;
constexpr int64_t kVectors = kHeadDim / 8;
constexpr int64_t kBlock = 32;  // positions per KV block
constexpr int64_t kKvHeads = 8;
constexpr int64_t kQueryTile = 32;  // queries of one sequence a unit serves (a prefill chunk)
constexpr int64_t kChunk = 64;      // K or V rows widened at a time (32 KB of float32)
constexpr int64_t kAhead = 16;      // rows prefetched ahead of the one being widened
constexpr int64_t kGroupRows = 4;   // positions a decode unit widens at a time (16 KB of float32)
constexpr int64_t kUnitsPerThread = 2;  // a decode round's units per thread, at least
// The fewest KV heads a decode unit reads a position's span of (DecodeUnit); a round whose
// units would be narrower (one sequence on four threads: 2 heads, 512 bytes every 2 KB) runs
// Unit's one head per unit, whose chunk-at-a-time widening reads such short strided spans
// faster. Where every thread still gets a unit of kSpanHeads, the round takes those instead
// (one sequence on two threads: two units of 4 heads, 1 KB of every 2 KB), which streamed faster
// than Unit's one head per unit.
constexpr int64_t kSpanHeads = 4;
constexpr int64_t kRowBytes = kHeadDim * sizeof(uint16_t);

typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// Eight BF16 bit patterns -> eight float32 (exact: the bits become the top half).
inline v8 Widen(const uint16_t* p) {
#if defined(__AVX2__)  // one vpmovzxwd: the compiler's conversion took two halves and an insert
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<v8>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#else
  u16x8 bits;
  std::memcpy(&bits, p, sizeof bits);
  u32x8 wide = __builtin_convertvector(bits, u32x8) << 16;
  v8 out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
#endif
}

inline float Sum(v8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

#if defined(__AVX2__)
// Sum of each of four dots' even + odd e[i], times `scale`, into out[0..3]: one tree of vector
// adds of Sum's own pairs (hadd's lanes: e0 + e1 and e2 + e3 of each e, then those two's sum,
// per 128-bit half; the halves' sum is Sum's last add), so the same bits as Sum.
inline void Sums4(const __m256 (&e)[4], float scale, float* out) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(e[0], e[1]), _mm256_hadd_ps(e[2], e[3]));
  const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  _mm_storeu_ps(out, _mm_mul_ps(sums, _mm_set1_ps(scale)));
}
#endif

#if !defined(__AVX512F__)
// Four dots' Sum(even + odd) times `scale` into out[0..3].
inline void Sum4(const v8 (&even)[4], const v8 (&odd)[4], float scale, float* out) {
#if defined(__AVX2__)
  __m256 e[4];
  for (int i = 0; i < 4; ++i) e[i] = reinterpret_cast<__m256>(even[i] + odd[i]);
  Sums4(e, scale, out);
#else
  for (int i = 0; i < 4; ++i) out[i] = Sum(even[i] + odd[i]) * scale;
#endif
}

// A query's dots with C (1 or 4) rows key, key + stride, ..., times `scale`, into out: each
// the even and odd chains of 8 fused multiply-adds (vectors 0, 2, ... and 1, 3, ... of the 16)
// and Sum, four rows' chains side by side so that each query vector is loaded once for them
// (holding all 16 in registers, as the AVX-512 builds do, would spill AVX2's 16).
template <int C>
inline void Dots(const float* query, const float* key, int64_t stride, float scale,
                 float* out) {
  v8 even[4] = {}, odd[4] = {};
  for (int64_t j = 0; j < kVectors; j += 2) {
    const v8 qe = Load(query + 8 * j), qo = Load(query + 8 * j + 8);
    for (int i = 0; i < C; ++i) {
      even[i] = Fma(qe, Load(key + i * stride + 8 * j), even[i]);
      odd[i] = Fma(qo, Load(key + i * stride + 8 * j + 8), odd[i]);
    }
  }
  if constexpr (C == 4) {
    Sum4(even, odd, scale, out);
  } else {
    for (int i = 0; i < C; ++i) out[i] = Sum(even[i] + odd[i]) * scale;
  }
}

// Dots over `count` rows: four at a time, then one at a time.
inline void DotRows(const float* query, const float* key, int64_t stride, int64_t count,
                    float scale, float* out) {
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) Dots<4>(query, key + i * stride, stride, scale, out + i);
  for (; i < count; ++i) Dots<1>(query, key + i * stride, stride, scale, out + i);
}

// acc[0..16) += weights[i] * value rows i (at value + i * stride), i = 0..count, each lane's
// fused multiply-adds in i order: 8 of the 16 vectors at a time, which with the weight and
// a value vector fill AVX2's 16 registers where all 16 would spill.
inline void WeightedSum(v8* acc, const float* weights, const float* value, int64_t stride,
                        int64_t count) {
  for (int64_t half = 0; half < kVectors; half += kVectors / 2) {
    v8 sum[kVectors / 2];
    for (int64_t j = 0; j < kVectors / 2; ++j) sum[j] = acc[half + j];
    for (int64_t i = 0; i < count; ++i) {
      const v8 w = Broadcast(weights[i]);
      for (int64_t j = 0; j < kVectors / 2; ++j) {
        sum[j] = Fma(w, Load(value + i * stride + 8 * (half + j)), sum[j]);
      }
    }
    for (int64_t j = 0; j < kVectors / 2; ++j) acc[half + j] = sum[j];
  }
}
#endif

#if defined(__AVX512F__)
inline __m512 Widen16(const uint16_t* p) {  // sixteen at once, the same bits
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// even + odd of a dot's two chains held in one 16-lane vector (the even vectors' chain in the
// low 8 lanes, the odd ones' in the high 8: the same FMAs); Sum of it is the dot.
inline __m256 EvenPlusOdd(__m512 both) {
  return _mm256_add_ps(_mm512_castps512_ps256(both),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(both), 1)));
}

// A query's dot with one widened row: both chains in one 16-lane one (the AVX-512 builds').
inline float Dot16(const __m512 (&qv)[kVectors / 2], const float* key) {
  __m512 both = _mm512_setzero_ps();
  for (int64_t j = 0; j < kVectors / 2; ++j) {
    both = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(key + 16 * j), both);
  }
  return Sum(reinterpret_cast<v8>(EvenPlusOdd(both)));
}

// Dot16 of a query with rows key, key + stride, ..., 4 of them, times `scale`, into out[0..3]:
// the four chains side by side, their sums in one tree (Sums4).
inline void Dot16x4(const __m512 (&qv)[kVectors / 2], const float* key, int64_t stride,
                    float scale, float* out) {
  __m512 both[4];
  for (int i = 0; i < 4; ++i) both[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < kVectors / 2; ++j) {
    for (int i = 0; i < 4; ++i) {
      both[i] = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(key + i * stride + 16 * j), both[i]);
    }
  }
  __m256 e[4];
  for (int i = 0; i < 4; ++i) e[i] = EvenPlusOdd(both[i]);
  Sums4(e, scale, out);
}

#endif

// scores[0, n) -> their softmax, in place: one code for every unit, so the same bits. The sum
// runs in 16 lanes (lane j: scores j, j + 16, ...), then a fixed tree, not one chain of adds.
// libm's exp, not a vectorized polynomial: one within 3 ulp moved batched and isolated rows
// apart past the JAX backend's batched gate (tests/test_gates.py).
inline void Softmax(float* scores, int64_t n) {
  const float top = *std::max_element(scores, scores + n);
  float lanes[16] = {};
  int64_t p = 0;
  for (; p + 16 <= n; p += 16) {
    for (int j = 0; j < 16; ++j) {
      scores[p + j] = std::exp(scores[p + j] - top);
      lanes[j] += scores[p + j];
    }
  }
  for (int j = 0; p + j < n; ++j) {
    scores[p + j] = std::exp(scores[p + j] - top);
    lanes[j] += scores[p + j];
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  const float total = lanes[0];
  for (int64_t i = 0; i < n; ++i) scores[i] /= total;
}

struct Problem {
  const float* q;         // [S, Tq, H, 128]
  const uint16_t* k;      // layer's slab [blocks, 32, 8, 128]
  const uint16_t* v;
  const int32_t* pos;     // [S, Tq]
  const int32_t* tables;  // [S, B]
  float* out;             // [S, Tq, H, 128]
  int64_t queries, heads, group, blocks, table_width;
  float scale;

  // Sequence s's K (or V) row at position p, KV head g.
  const uint16_t* Row(const uint16_t* slab, int64_t s, int64_t p, int64_t g) const {
    int64_t block = tables[s * table_width + p / kBlock];
    block = std::min<int64_t>(std::max<int64_t>(block, 0), blocks - 1);
    return slab + ((block * kBlock + p % kBlock) * kKvHeads + g) * kHeadDim;
  }

  // Positions [first, end) of KV head g's K or V rows, widened into rows [0, end - first) of
  // `into` (kChunk rows of 128 floats).
  // A KV head's rows sit 2 KB apart (all 8 heads of a position between them), a stride the
  // hardware prefetcher does not follow across pages: each row was a cache miss waited on in
  // turn, so the rows kAhead positions on are asked for while this one is widened.
  void WidenRows(const uint16_t* slab, int64_t s, int64_t g, int64_t first, int64_t end,
                 float* into) const {
    const int64_t limit = table_width * kBlock;
    for (int64_t p = first; p < end; ++p) {
      if (p + kAhead < limit) {
        const char* ahead = reinterpret_cast<const char*>(Row(slab, s, p + kAhead, g));
        for (int64_t line = 0; line < kRowBytes; line += 64) __builtin_prefetch(ahead + line, 0, 2);
      }
      const uint16_t* row = Row(slab, s, p, g);
      float* out = into + (p - first) * kHeadDim;
#if defined(__AVX512F__)
      for (int64_t j = 0; j < kHeadDim; j += 16) _mm512_storeu_ps(out + j, Widen16(row + j));
#else
      for (int64_t j = 0; j < kVectors; ++j) Store(out + 8 * j, Widen(row + 8 * j));
#endif
    }
  }

  // Sequence s, KV head g, queries [t0, t0 + tiles): their `group` query heads each. K and V
  // are widened a chunk of positions at a time, once for all of them, and each query's vector
  // (or accumulator) stays in registers across a chunk. Each query's own arithmetic is the
  // same whatever the tile or chunk (its dots, softmax and sums in position order), so a
  // decode round's query and a prefill chunk's at the same position give the same bits.
  void Unit(int64_t s, int64_t g, int64_t t0, int64_t tiles, std::vector<float>& scores,
            std::vector<v8>& acc, float* rows_buffer) const {
    const int64_t rows = tiles * group, limit = table_width * kBlock;
    int64_t reach[kQueryTile], longest = 0;  // positions each query sees
    for (int64_t t = 0; t < tiles; ++t) {
      reach[t] = std::min<int64_t>(pos[s * queries + t0 + t], limit - 1) + 1;
      longest = std::max(longest, reach[t]);
    }
    scores.resize(rows * std::max<int64_t>(longest, 1));
    acc.assign(rows * kVectors, v8{});
    auto query = [&](int64_t t, int64_t h) {
      return q + ((s * queries + t0 + t) * heads + g * group + h) * kHeadDim;
    };
    for (int64_t first = 0; first < longest; first += kChunk) {
      const int64_t end = std::min(longest, first + kChunk);
      WidenRows(k, s, g, first, end, rows_buffer);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t stop = std::min(end, reach[t]);
        for (int64_t h = 0; h < group && first < stop; ++h) {
          float* out_scores = scores.data() + (t * group + h) * longest;
#if defined(__AVX512F__)
          __m512 qv[kVectors / 2];
          for (int64_t j = 0; j < kVectors / 2; ++j) qv[j] = _mm512_loadu_ps(query(t, h) + 16 * j);
          int64_t p = first;
          for (; p + 4 <= stop; p += 4) {
            Dot16x4(qv, rows_buffer + (p - first) * kHeadDim, kHeadDim, scale, out_scores + p);
          }
          for (; p < stop; ++p) {
            out_scores[p] = Dot16(qv, rows_buffer + (p - first) * kHeadDim) * scale;
          }
#else
          DotRows(query(t, h), rows_buffer, kHeadDim, stop - first, scale, out_scores + first);
#endif
        }
      }
    }
    for (int64_t t = 0; t < tiles; ++t) {  // softmax over each query's positions, in place
      for (int64_t h = 0; h < group && reach[t] > 0; ++h) {
        Softmax(scores.data() + (t * group + h) * longest, reach[t]);
      }
    }
    for (int64_t first = 0; first < longest; first += kChunk) {
      const int64_t end = std::min(longest, first + kChunk);
      WidenRows(v, s, g, first, end, rows_buffer);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t stop = std::min(end, reach[t]);
        for (int64_t h = 0; h < group && first < stop; ++h) {
          v8* a = acc.data() + (t * group + h) * kVectors;
          const float* weights = scores.data() + (t * group + h) * longest;
#if defined(__AVX512F__)  // two of the 8-lane sums per instruction, each lane's FMAs the same
          float* af = reinterpret_cast<float*>(a);
          __m512 sum[kVectors / 2];
          for (int64_t j = 0; j < kVectors / 2; ++j) sum[j] = _mm512_loadu_ps(af + 16 * j);
          for (int64_t p = first; p < stop; ++p) {
            const __m512 w = _mm512_set1_ps(weights[p]);
            const float* value = rows_buffer + (p - first) * kHeadDim;
            for (int64_t j = 0; j < kVectors / 2; ++j) {
              sum[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(value + 16 * j), sum[j]);
            }
          }
          for (int64_t j = 0; j < kVectors / 2; ++j) _mm512_storeu_ps(af + 16 * j, sum[j]);
#else
          WeightedSum(a, weights + first, rows_buffer, kHeadDim, stop - first);
#endif
        }
      }
    }
    for (int64_t t = 0; t < tiles; ++t) {  // a padding query (no positions) gets zeros
      float* o = out + ((s * queries + t0 + t) * heads + g * group) * kHeadDim;
      for (int64_t h = 0; h < group; ++h)
        for (int64_t j = 0; j < kVectors; ++j)
          Store(o + h * kHeadDim + 8 * j, acc[(t * group + h) * kVectors + j]);
    }
  }

  // A decode round's unit: sequence s's one query (queries == 1), KV heads [g0, g0 + count).
  // Positions in order, kGroupRows at a time, each position's `count` heads (one contiguous span
  // of its row: the heads of a position sit side by side) widened at once for all their query
  // heads, so the unit reads one stream where a unit per KV head read 256 bytes every 2 KB; a
  // query head's vector (its accumulator, for V) is loaded once for the group's positions. Each
  // query head's arithmetic is Unit's: the same dot chains, softmax and position-ordered sums,
  // so the same bits.
  void DecodeUnit(int64_t s, int64_t g0, int64_t count, std::vector<float>& scores,
                  std::vector<v8>& acc, float* rows_buffer) const {
    const int64_t limit = table_width * kBlock, width = count * kHeadDim;
    const int64_t reach = std::min<int64_t>(pos[s], limit - 1) + 1;  // 0: a padding query
    const int64_t rows = count * group, first_head = g0 * group;
    const float* query = q + (s * heads + first_head) * kHeadDim;
    scores.resize(rows * std::max<int64_t>(reach, 1));
    acc.assign(rows * kVectors, v8{});
    auto widen = [&](const uint16_t* slab, int64_t p, float* row) {  // p's heads into `row`
      if (p + kAhead < limit) {
        const char* ahead = reinterpret_cast<const char*>(Row(slab, s, p + kAhead, g0));
        for (int64_t line = 0; line < count * kRowBytes; line += 64) {
          __builtin_prefetch(ahead + line, 0, 2);
        }
      }
      const uint16_t* bits = Row(slab, s, p, g0);
#if defined(__AVX512F__)
      for (int64_t j = 0; j < width; j += 16) _mm512_storeu_ps(row + j, Widen16(bits + j));
#else
      for (int64_t j = 0; j < width / 8; ++j) Store(row + 8 * j, Widen(bits + 8 * j));
#endif
    };
    for (int64_t p0 = 0; p0 < reach; p0 += kGroupRows) {
      const int64_t n = std::min(kGroupRows, reach - p0);
      for (int64_t i = 0; i < n; ++i) widen(k, p0 + i, rows_buffer + i * width);
      for (int64_t r = 0; r < rows; ++r) {
        const float* qh = query + r * kHeadDim;
        const float* key = rows_buffer + (r / group) * kHeadDim;
#if defined(__AVX512F__)
        for (int64_t i = 0; i < n; ++i, key += width) {
          // the even chain in the low 8 lanes, the odd one in the high 8: the same FMAs
          __m512 both = _mm512_setzero_ps();
          for (int64_t j = 0; j < kVectors; j += 2) {
            both = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 8 * j), _mm512_loadu_ps(key + 8 * j),
                                   both);
          }
          const v8 even = reinterpret_cast<v8>(_mm512_castps512_ps256(both));
          const v8 odd = reinterpret_cast<v8>(
              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(both), 1)));
          scores[r * reach + p0 + i] = Sum(even + odd) * scale;
        }
#else
        DotRows(qh, key, width, n, scale, scores.data() + r * reach + p0);
#endif
      }
    }
    for (int64_t r = 0; r < rows && reach > 0; ++r) Softmax(scores.data() + r * reach, reach);
    for (int64_t p0 = 0; p0 < reach; p0 += kGroupRows) {
      const int64_t n = std::min(kGroupRows, reach - p0);
      for (int64_t i = 0; i < n; ++i) widen(v, p0 + i, rows_buffer + i * width);
      for (int64_t r = 0; r < rows; ++r) {
        const float* value = rows_buffer + (r / group) * kHeadDim;
        const float* weights = scores.data() + r * reach + p0;
        v8* a = acc.data() + r * kVectors;
#if defined(__AVX512F__)  // two of the 8-lane sums per instruction, each lane's FMAs the same
        float* af = reinterpret_cast<float*>(a);
        __m512 sum[kVectors / 2];
        for (int64_t j = 0; j < kVectors; j += 2) sum[j / 2] = _mm512_loadu_ps(af + 8 * j);
        for (int64_t i = 0; i < n; ++i, value += width) {
          const __m512 w = _mm512_set1_ps(weights[i]);
          for (int64_t j = 0; j < kVectors; j += 2) {
            sum[j / 2] = _mm512_fmadd_ps(w, _mm512_loadu_ps(value + 8 * j), sum[j / 2]);
          }
        }
        for (int64_t j = 0; j < kVectors; j += 2) _mm512_storeu_ps(af + 8 * j, sum[j / 2]);
#else
        WeightedSum(a, weights, value, width, n);
#endif
      }
    }
    float* o = out + (s * heads + first_head) * kHeadDim;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < kVectors; ++j) Store(o + r * kHeadDim + 8 * j, acc[r * kVectors + j]);
  }
};

// The shared checks and the parallel loop: q [S, Tq, H, 128] (`dims` its dimensions, with
// `lead` the S and Tq ones), pos [S, Tq].
ffi::Error Run(ffi::ThreadPool& pool, const char* name, ffi::Span<const int64_t> qd,
               int64_t sequences, int64_t queries, ffi::Buffer<ffi::F32>& q,
               ffi::Buffer<ffi::U16>& k, ffi::Buffer<ffi::U16>& v, ffi::Buffer<ffi::S32>& layer,
               ffi::Buffer<ffi::S32>& pos, ffi::Buffer<ffi::S32>& tables,
               ffi::ResultBuffer<ffi::F32>& out) {
  const auto kd = k.dimensions();
  const auto td = tables.dimensions();
  auto same = [](auto a, auto b) { return std::equal(a.begin(), a.end(), b.begin(), b.end()); };
  const int64_t heads = qd[qd.size() - 2];
  if (qd.back() != kHeadDim || heads % kKvHeads || kd.size() != 5 || kd[1] < 1 ||
      kd[2] != kBlock || kd[3] != kKvHeads || kd[4] != kHeadDim || !same(v.dimensions(), kd) ||
      layer.element_count() != 1 ||
      static_cast<int64_t>(pos.element_count()) != sequences * queries || td.size() != 2 ||
      td[0] != sequences || td[1] < 1 || !same(out->dimensions(), qd)) {
    return ffi::Error::InvalidArgument(
        std::string(name) + ": expected q [S, (Tq,) H, 128] float32, k and v [L, blocks, 32, "
        "8, 128] uint16, layer [1], pos [S(, Tq)], tables [S, B] int32, out as q");
  }
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= kd[0]) {
    return ffi::Error::InvalidArgument(std::string(name) + ": layer out of range");
  }
  const int64_t layer_size = kd[1] * kBlock * kKvHeads * kHeadDim;
  Problem problem{q.typed_data(), k.typed_data() + index * layer_size,
                  v.typed_data() + index * layer_size, pos.typed_data(), tables.typed_data(),
                  out->typed_data(), queries, heads, heads / kKvHeads, kd[1], td[1],
                  static_cast<float>(1.0 / std::sqrt(static_cast<double>(kHeadDim)))};
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t pieces = 1;  // a decode round's units per sequence: enough to keep every thread busy
  while (pieces < kKvHeads && sequences * pieces < kUnitsPerThread * threads) pieces *= 2;
  // but no narrower than kSpanHeads where every thread still gets a unit
  while (pieces > 1 && kKvHeads / pieces < kSpanHeads && sequences * pieces / 2 >= threads) {
    pieces /= 2;
  }
  const int64_t count = kKvHeads / pieces;
  if (queries == 1 && count >= kSpanHeads) {  // a decode round of units of a sequence's KV heads
    kipp::ParallelFor(pool, sequences * pieces, 1, [&problem, pieces, count](int64_t u) {
      thread_local std::vector<float> scores;
      thread_local std::vector<v8> acc;
      thread_local std::vector<float> rows(kGroupRows * kKvHeads * kHeadDim);
      problem.DecodeUnit(u / pieces, (u % pieces) * count, count, scores, acc, rows.data());
    });
    return ffi::Error::Success();
  }
  const int64_t tiles = (queries + kQueryTile - 1) / kQueryTile;
  kipp::ParallelFor(pool, sequences * kKvHeads * tiles, 1, [&problem, tiles, queries](int64_t u) {
    thread_local std::vector<float> scores;
    thread_local std::vector<v8> acc;
    thread_local std::vector<float> rows(kChunk * kHeadDim);
    const int64_t tile = u % tiles, rest = u / tiles;
    const int64_t t0 = tile * kQueryTile;
    problem.Unit(rest / kKvHeads, rest % kKvHeads, t0, std::min(kQueryTile, queries - t0),
                 scores, acc, rows.data());
  });
  return ffi::Error::Success();
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::U16> k, ffi::Buffer<ffi::U16> v,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pos,
                           ffi::Buffer<ffi::S32> tables, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  if (qd.size() != 3) {
    return ffi::Error::InvalidArgument("kipp_cpu_decode_attention: expected q [S, H, 128]");
  }
  return Run(pool, "kipp_cpu_decode_attention", qd, qd[0], 1, q, k, v, layer, pos, tables, out);
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U16> k,
                     ffi::Buffer<ffi::U16> v, ffi::Buffer<ffi::S32> layer,
                     ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> tables,
                     ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  if (qd.size() != 4) {
    return ffi::Error::InvalidArgument("kipp_cpu_attention: expected q [S, Tq, H, 128]");
  }
  return Run(pool, "kipp_cpu_attention", qd, qd[0], qd[1], q, k, v, layer, pos, tables, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KippCpuDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::U16>>()  // k
                                  .Arg<ffi::Buffer<ffi::U16>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(KippCpuAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [S, Tq, H, 128]
                                  .Arg<ffi::Buffer<ffi::U16>>()  // k
                                  .Arg<ffi::Buffer<ffi::U16>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos [S, Tq]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out
