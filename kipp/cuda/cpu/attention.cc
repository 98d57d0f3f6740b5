// Kipp's CPU decode attention for the JAX backend: one query per sequence over the paged BF16
// KV slab, an XLA FFI handler (kipp/cuda/cpu/attention.py).
//
// The step has already stored this round's rows in the slab (its own in-place scatter); the
// handler only reads it:
// out[s, h] = softmax_p(q[s, h] . K[s, p, h / group] * 128^-0.5) . V[s, p, h / group] over the
// positions p = 0..pos[s] of sequence s, position p read at slab row
// tables[s, p / 32] * 32 + p % 32 (a block outside the slab clamped into it: the backend's
// checks keep tables inside it, so this only bounds the reads), from
// layer `layer` of a slab [layers, blocks, 32, 8, 128] of BF16 bit patterns (uint16). A
// sequence with pos < 0 (a padding row) gets zeros.
//
// Why: the jax.numpy twin gathers each sequence's rows, widens and (for the grouped form)
// transposes them before two tiny batched dots, which made an 8-sequence decode step grow with
// context on XLA's CPU (bench/results/*-batch_scaling-*). Here each unit of work, one sequence
// and one KV head, reads its K and V rows once, straight from the slab, and serves the `group`
// query heads that share them: scores for every position, then the softmax, then the weighted
// sum of V rows. Float32 throughout; each dot is two chains of 8 eight-wide fused multiply-adds
// (even and odd vectors) then a fixed pairwise sum, so a sequence's result does not depend on
// the others in the round or on the thread split.
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

typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// Eight BF16 bit patterns -> eight float32 (exact: the bits become the top half).
inline v8 Widen(const uint16_t* p) {
  u16x8 bits;
  std::memcpy(&bits, p, sizeof bits);
  u32x8 wide = __builtin_convertvector(bits, u32x8) << 16;
  v8 out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
}

inline float Sum(v8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

struct Problem {
  const float* q;         // [S, H, 128]
  const uint16_t* k;      // layer's slab [blocks, 32, 8, 128]
  const uint16_t* v;
  const int32_t* pos;     // [S]
  const int32_t* tables;  // [S, B]
  float* out;             // [S, H, 128]
  int64_t heads, group, blocks, table_width;
  float scale;

  // Sequence s's K (or V) row at position p, KV head g.
  const uint16_t* Row(const uint16_t* slab, int64_t s, int64_t p, int64_t g) const {
    int64_t block = tables[s * table_width + p / kBlock];
    block = std::min<int64_t>(std::max<int64_t>(block, 0), blocks - 1);
    return slab + ((block * kBlock + p % kBlock) * kKvHeads + g) * kHeadDim;
  }

  // Sequence s, KV head g: its `group` query heads.
  void Unit(int64_t s, int64_t g, std::vector<float>& scores) const {
    const int64_t first = g * group;
    float* o = out + (s * heads + first) * kHeadDim;
    const int64_t n = std::min<int64_t>(pos[s], table_width * kBlock - 1) + 1;
    if (n <= 0) {
      std::fill(o, o + group * kHeadDim, 0.0f);
      return;
    }
    scores.resize(group * n);
    const float* qs = q + (s * heads + first) * kHeadDim;
    for (int64_t p = 0; p < n; ++p) {
      const uint16_t* row = Row(k, s, p, g);
      v8 key[kVectors];
      for (int64_t j = 0; j < kVectors; ++j) key[j] = Widen(row + 8 * j);
      for (int64_t h = 0; h < group; ++h) {
        const float* qh = qs + h * kHeadDim;
        v8 even = v8{}, odd = v8{};
        for (int64_t j = 0; j < kVectors; j += 2) {
          even = Fma(Load(qh + 8 * j), key[j], even);
          odd = Fma(Load(qh + 8 * j + 8), key[j + 1], odd);
        }
        scores[h * n + p] = Sum(even + odd) * scale;
      }
    }
    for (int64_t h = 0; h < group; ++h) {  // softmax over the positions, in place
      float* sh = scores.data() + h * n;
      const float top = *std::max_element(sh, sh + n);
      float total = 0.0f;
      for (int64_t p = 0; p < n; ++p) {
        sh[p] = std::exp(sh[p] - top);
        total += sh[p];
      }
      for (int64_t p = 0; p < n; ++p) sh[p] /= total;
    }
    std::vector<v8> acc(group * kVectors, v8{});
    for (int64_t p = 0; p < n; ++p) {
      const uint16_t* row = Row(v, s, p, g);
      v8 value[kVectors];
      for (int64_t j = 0; j < kVectors; ++j) value[j] = Widen(row + 8 * j);
      for (int64_t h = 0; h < group; ++h) {
        const v8 w = Broadcast(scores[h * n + p]);
        for (int64_t j = 0; j < kVectors; ++j)
          acc[h * kVectors + j] = Fma(w, value[j], acc[h * kVectors + j]);
      }
    }
    for (int64_t h = 0; h < group; ++h)
      for (int64_t j = 0; j < kVectors; ++j) Store(o + h * kHeadDim + 8 * j, acc[h * kVectors + j]);
  }
};

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::U16> k, ffi::Buffer<ffi::U16> v,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pos,
                           ffi::Buffer<ffi::S32> tables, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto td = tables.dimensions();
  auto same = [](auto a, auto b) { return std::equal(a.begin(), a.end(), b.begin(), b.end()); };
  if (qd.size() != 3 || qd[2] != kHeadDim || qd[1] % kKvHeads || kd.size() != 5 ||
      kd[1] < 1 || kd[2] != kBlock || kd[3] != kKvHeads || kd[4] != kHeadDim ||
      !same(v.dimensions(), kd) || layer.element_count() != 1 ||
      pos.element_count() != qd[0] || td.size() != 2 || td[0] != qd[0] || td[1] < 1 ||
      !same(out->dimensions(), qd)) {
    return ffi::Error::InvalidArgument(
        "kipp_cpu_decode_attention: expected q [S, H, 128] float32, k and v [L, blocks, 32, "
        "8, 128] uint16, layer [1], pos [S], tables [S, B] int32, out [S, H, 128]");
  }
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= kd[0]) {
    return ffi::Error::InvalidArgument("kipp_cpu_decode_attention: layer out of range");
  }
  const int64_t layer_size = kd[1] * kBlock * kKvHeads * kHeadDim;
  Problem problem{q.typed_data(), k.typed_data() + index * layer_size,
                  v.typed_data() + index * layer_size, pos.typed_data(), tables.typed_data(),
                  out->typed_data(), qd[1], qd[1] / kKvHeads, kd[1], td[1],
                  static_cast<float>(1.0 / std::sqrt(static_cast<double>(kHeadDim)))};
  const int64_t sequences = qd[0];
  kipp::ParallelFor(pool, sequences * kKvHeads, 1, [&problem](int64_t u) {
    thread_local std::vector<float> scores;
    problem.Unit(u / kKvHeads, u % kKvHeads, scores);
  });
  return ffi::Error::Success();
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
