// The part of the Metal Shading Language that Kipp's kernels use, as C++ for the CPU.
//
// Included before the exact source MLX generates for an mx.fast.metal_kernel (header, template,
// signature, body, explicit instantiation), which metal_emulator/source.py turns into C++:
// `threadgroup` arrays become per-threadgroup allocations, the address-space words vanish (or,
// in strict mode, become clang address spaces: metal_emulator_strict.h).
//
// Semantics kept from Metal: 32-bit `uint`, 64-bit `size_t`/`ulong`, IEEE `half` (_Float16),
// `bfloat` storage with round-to-nearest-even from float, vector types with .xyzw and
// component-wise arithmetic, `as_type` bit casts, simd reductions and shuffles over the live
// lanes of a simdgroup, simdgroup 8x8 matrices with each lane holding its two elements (the
// layout MLX's GEMM kernels assume), threadgroup barriers. Not modelled: atomics, textures,
// swizzles beyond .xyzw, fast-math and Apple's rounding and FMA order (see the README).
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "metal_emulator_abi.h"

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef uint64_t ulong;
typedef _Float16 half;

// bfloat16 storage. Conversion from float rounds to nearest, ties to even (NaN stays NaN);
// arithmetic happens in float, as on the GPU.
struct bfloat {
  uint16_t bits = 0;
  bfloat() = default;
  bfloat(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((u >> 16) | 0x40);
      return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = uint16_t(u >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
};

// The emulator's own simd bookkeeping (not the kernel's memory accesses) runs unsanitized.
#if defined(__clang__)
#define MSLEMU_UNCHECKED __attribute__((no_sanitize("address", "thread", "undefined")))
#else
#define MSLEMU_UNCHECKED __attribute__((no_sanitize_address, no_sanitize_thread, no_sanitize_undefined))
#endif

namespace mslemu {
template <class T>
constexpr bool is_scalar_v = std::is_arithmetic<T>::value || std::is_same<T, half>::value ||
                             std::is_same<T, bfloat>::value;
}

template <class T, int N> struct vec_storage { T v[N]; };
template <class T> struct vec_storage<T, 2> { union { T v[2]; struct { T x, y; }; }; };
template <class T> struct vec_storage<T, 3> { union { T v[3]; struct { T x, y, z; }; }; };
template <class T> struct vec_storage<T, 4> { union { T v[4]; struct { T x, y, z, w; }; }; };

// Metal's vector types (float4, uint3, ...): a scalar constructor fills every component.
template <class T, int N>
struct vec : vec_storage<T, N> {
  vec() { for (int i = 0; i < N; ++i) this->v[i] = T(0); }
  vec(T s) { for (int i = 0; i < N; ++i) this->v[i] = s; }
  template <class... A, class = std::enable_if_t<sizeof...(A) == N && (N > 1)>>
  vec(A... a) {
    T t[] = {T(a)...};
    for (int i = 0; i < N; ++i) this->v[i] = t[i];
  }
  template <class U> explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) this->v[i] = T(o.v[i]);
  }
  vec(const vec& o) { for (int i = 0; i < N; ++i) this->v[i] = o.v[i]; }
  vec& operator=(const vec& o) {
    for (int i = 0; i < N; ++i) this->v[i] = o.v[i];
    return *this;
  }
  T& operator[](int i) { return this->v[i]; }
  const T& operator[](int i) const { return this->v[i]; }
  vec operator-() const {
    vec r;
    for (int i = 0; i < N; ++i) r.v[i] = -this->v[i];
    return r;
  }
#define MSLEMU_COMPOUND(op)                                              \
  vec& operator op##=(const vec& o) {                                  \
    for (int i = 0; i < N; ++i) this->v[i] = T(this->v[i] op o.v[i]); \
    return *this;                                                      \
  }
  MSLEMU_COMPOUND(+) MSLEMU_COMPOUND(-) MSLEMU_COMPOUND(*) MSLEMU_COMPOUND(/)
#undef MSLEMU_COMPOUND
};

#define MSLEMU_BINARY(op)                                                                    \
  template <class T, int N>                                                                  \
  vec<T, N> operator op(vec<T, N> a, const vec<T, N>& b) { return a op##= b; }              \
  template <class T, int N, class S, class = std::enable_if_t<mslemu::is_scalar_v<S>>>      \
  vec<T, N> operator op(vec<T, N> a, S s) { return a op##= vec<T, N>(T(s)); }               \
  template <class T, int N, class S, class = std::enable_if_t<mslemu::is_scalar_v<S>>>      \
  vec<T, N> operator op(S s, const vec<T, N>& b) { return vec<T, N>(T(s)) op b; }
MSLEMU_BINARY(+) MSLEMU_BINARY(-) MSLEMU_BINARY(*) MSLEMU_BINARY(/)
#undef MSLEMU_BINARY

#define MSLEMU_VECTORS(T, name) \
  typedef vec<T, 2> name##2;    \
  typedef vec<T, 3> name##3;    \
  typedef vec<T, 4> name##4;
MSLEMU_VECTORS(float, float) MSLEMU_VECTORS(half, half) MSLEMU_VECTORS(bfloat, bfloat)
MSLEMU_VECTORS(int, int) MSLEMU_VECTORS(uint, uint) MSLEMU_VECTORS(short, short)
MSLEMU_VECTORS(ushort, ushort) MSLEMU_VECTORS(char, char) MSLEMU_VECTORS(uchar, uchar)
MSLEMU_VECTORS(int64_t, long) MSLEMU_VECTORS(ulong, ulong) MSLEMU_VECTORS(bool, bool)
#undef MSLEMU_VECTORS

namespace metal {

template <class T, class U>
inline T as_type(const U& u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: the two types differ in size");
  T t;
  memcpy(&t, &u, sizeof(T));
  return t;
}

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

inline void threadgroup_barrier(mem_flags, int line = __builtin_LINE()) {
  mslemu::threadgroup_barrier("threadgroup_barrier", line);
}
inline void simdgroup_barrier(mem_flags, int line = __builtin_LINE()) {
  mslemu::simd_gather(nullptr, 0, "simdgroup_barrier", line);
}

// Scalar math in float (unqualified calls must not widen to double, as on the GPU). The C
// library's functions are reached through compiler builtins: <math.h> would put the double and
// std:: overloads beside these and make `fma(float, float, float)` ambiguous.
#define MSLEMU_UNARY(name, impl) \
  inline float name(float x) { return __builtin_##impl(x); }
MSLEMU_UNARY(exp, expf) MSLEMU_UNARY(exp2, exp2f) MSLEMU_UNARY(log, logf)
MSLEMU_UNARY(log2, log2f) MSLEMU_UNARY(sqrt, sqrtf) MSLEMU_UNARY(abs, fabsf)
MSLEMU_UNARY(fabs, fabsf) MSLEMU_UNARY(tanh, tanhf) MSLEMU_UNARY(sin, sinf)
MSLEMU_UNARY(cos, cosf) MSLEMU_UNARY(floor, floorf) MSLEMU_UNARY(ceil, ceilf)
MSLEMU_UNARY(round, roundf) MSLEMU_UNARY(trunc, truncf)
#undef MSLEMU_UNARY
inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float pow(float a, float b) { return __builtin_powf(a, b); }
inline bool isnan(float x) { return x != x; }
inline bool isinf(float x) { return __builtin_fabsf(x) == __builtin_inff(); }
inline bool isfinite(float x) { return !isnan(x) && !isinf(x); }
template <class T> inline T max(T a, T b) { return a > b ? a : b; }
template <class T> inline T min(T a, T b) { return a < b ? a : b; }
inline float fmax(float a, float b) { return __builtin_fmaxf(a, b); }
inline float fmin(float a, float b) { return __builtin_fminf(a, b); }
template <class T> inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T> inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N> inline vec<T, N> max(vec<T, N> a, const vec<T, N>& b) {
  for (int i = 0; i < N; ++i) a.v[i] = max(a.v[i], b.v[i]);
  return a;
}
template <class T, int N> inline vec<T, N> min(vec<T, N> a, const vec<T, N>& b) {
  for (int i = 0; i < N; ++i) a.v[i] = min(a.v[i], b.v[i]);
  return a;
}
template <class T, int N> inline vec<T, N> exp(vec<T, N> a) {
  for (int i = 0; i < N; ++i) a.v[i] = T(exp(float(a.v[i])));
  return a;
}
template <class T, int N> inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = T(0);
  for (int i = 0; i < N; ++i) s += a.v[i] * b.v[i];
  return s;
}
namespace precise { using metal::exp; using metal::exp2; using metal::log; using metal::sqrt; using metal::rsqrt; using metal::tanh; }
namespace fast { using metal::exp; using metal::exp2; using metal::log; using metal::sqrt; using metal::rsqrt; using metal::tanh; }

// ---- simd functions: every live lane of the simdgroup calls them together ----------------

namespace detail {
template <class T>
MSLEMU_UNCHECKED inline T lane_value(const mslemu::Gathered& g, uint32_t lane) {
  T v;
  memcpy(&v, g.slots + lane * mslemu::kSlotBytes, sizeof(T));
  return v;
}
template <class T>
inline mslemu::Gathered gather(const T& v, const char* what, int line) {
  static_assert(sizeof(T) <= mslemu::kSlotBytes, "simd operation on a value too large");
  return mslemu::simd_gather(&v, sizeof(T), what, line);
}
// A butterfly over the 32 lane positions: lanes 0..15 take 16..31, then 0..7 take 8..15, ...
template <class T, class Op>
MSLEMU_UNCHECKED inline T reduce(const mslemu::Gathered& g, Op op) {
  T buf[mslemu::kSimdWidth];
  bool has[mslemu::kSimdWidth];
  for (int i = 0; i < mslemu::kSimdWidth; ++i) {
    has[i] = (g.lanes >> i) & 1u;
    if (has[i]) buf[i] = lane_value<T>(g, i);
  }
  for (int off = mslemu::kSimdWidth / 2; off > 0; off /= 2)
    for (int i = 0; i < off; ++i) {
      if (has[i] && has[i + off]) buf[i] = op(buf[i], buf[i + off]);
      else if (has[i + off]) { buf[i] = buf[i + off]; has[i] = true; }
    }
  return buf[0];
}
template <class T>
inline T from_lane(const mslemu::Gathered& g, uint32_t lane, const char* what) {
  if (lane >= uint32_t(mslemu::kSimdWidth) || !((g.lanes >> lane) & 1u))
    mslemu::fail("%s: lane %u reads lane %u, which is not active", what, g.me, lane);
  return lane_value<T>(g, lane);
}
}  // namespace detail

namespace detail {
struct Sum { template <class T> T operator()(T a, T b) const { return T(a + b); } };
struct Product { template <class T> T operator()(T a, T b) const { return T(a * b); } };
struct Max { template <class T> T operator()(T a, T b) const { return max(a, b); } };
struct Min { template <class T> T operator()(T a, T b) const { return min(a, b); } };
struct And { template <class T> T operator()(T a, T b) const { return T(a & b); } };
struct Or { template <class T> T operator()(T a, T b) const { return T(a | b); } };
struct Xor { template <class T> T operator()(T a, T b) const { return T(a ^ b); } };
struct All { bool operator()(bool a, bool b) const { return a && b; } };
struct Any { bool operator()(bool a, bool b) const { return a || b; } };
template <class T, class Op>
MSLEMU_UNCHECKED void compute_reduce(const mslemu::Gathered& g, void* out) {
  const T r = reduce<T>(g, Op());
  memcpy(out, &r, sizeof(T));
}
// Every lane gets the one reduction, computed once for the simdgroup.
template <class T, class Op>
inline T reduction(const T& v, const char* what, int line) {
  const mslemu::Gathered g = gather(v, what, line);
  T r;
  mslemu::simd_shared(g, &r, sizeof(T), &compute_reduce<T, Op>);
  return r;
}
}  // namespace detail

template <class T> inline T simd_sum(T v, int line = __builtin_LINE()) {
  return detail::reduction<T, detail::Sum>(v, "simd_sum", line);
}
template <class T> inline T simd_product(T v, int line = __builtin_LINE()) {
  return detail::reduction<T, detail::Product>(v, "simd_product", line);
}
template <class T> inline T simd_max(T v, int line = __builtin_LINE()) {
  return detail::reduction<T, detail::Max>(v, "simd_max", line);
}
template <class T> inline T simd_min(T v, int line = __builtin_LINE()) {
  return detail::reduction<T, detail::Min>(v, "simd_min", line);
}
template <class T> inline T simd_and(T v, int line = __builtin_LINE()) {
  return detail::reduction<T, detail::And>(v, "simd_and", line);
}
template <class T> inline T simd_or(T v, int line = __builtin_LINE()) {
  return detail::reduction<T, detail::Or>(v, "simd_or", line);
}
template <class T> inline T simd_xor(T v, int line = __builtin_LINE()) {
  return detail::reduction<T, detail::Xor>(v, "simd_xor", line);
}
inline bool simd_all(bool v, int line = __builtin_LINE()) {
  return detail::reduction<bool, detail::All>(v, "simd_all", line);
}
inline bool simd_any(bool v, int line = __builtin_LINE()) {
  return detail::reduction<bool, detail::Any>(v, "simd_any", line);
}
// Sums over the active lanes below the caller, in lane order.
template <class T> inline T simd_prefix_exclusive_sum(T v, int line = __builtin_LINE()) {
  auto g = detail::gather(v, "simd_prefix_exclusive_sum", line);
  T s = T(0);
  for (uint32_t i = 0; i < g.me; ++i)
    if ((g.lanes >> i) & 1u) s = T(s + detail::lane_value<T>(g, i));
  return s;
}
template <class T> inline T simd_prefix_inclusive_sum(T v, int line = __builtin_LINE()) {
  return T(simd_prefix_exclusive_sum(v, line) + v);
}
template <class T> inline T simd_shuffle(T v, ushort lane, int line = __builtin_LINE()) {
  return detail::from_lane<T>(detail::gather(v, "simd_shuffle", line), lane, "simd_shuffle");
}
template <class T> inline T simd_broadcast(T v, ushort lane, int line = __builtin_LINE()) {
  return detail::from_lane<T>(detail::gather(v, "simd_broadcast", line), lane, "simd_broadcast");
}
template <class T> inline T simd_broadcast_first(T v, int line = __builtin_LINE()) {
  auto g = detail::gather(v, "simd_broadcast_first", line);
  return detail::lane_value<T>(g, __builtin_ctz(g.lanes));
}
template <class T> inline T simd_shuffle_xor(T v, ushort mask, int line = __builtin_LINE()) {
  auto g = detail::gather(v, "simd_shuffle_xor", line);
  return detail::from_lane<T>(g, g.me ^ mask, "simd_shuffle_xor");
}
// The upper `delta` lanes keep their own value (no wrap-around), as Metal documents.
template <class T> inline T simd_shuffle_down(T v, ushort delta, int line = __builtin_LINE()) {
  auto g = detail::gather(v, "simd_shuffle_down", line);
  uint32_t src = g.me + delta;
  return src >= uint32_t(mslemu::kSimdWidth) ? v : detail::from_lane<T>(g, src, "simd_shuffle_down");
}
template <class T> inline T simd_shuffle_up(T v, ushort delta, int line = __builtin_LINE()) {
  auto g = detail::gather(v, "simd_shuffle_up", line);
  return delta > g.me ? v : detail::from_lane<T>(g, g.me - delta, "simd_shuffle_up");
}
inline bool simd_is_first(int line = __builtin_LINE()) {
  auto g = mslemu::simd_gather(nullptr, 0, "simd_is_first", line);
  return uint32_t(__builtin_ctz(g.lanes)) == g.me;
}

// ---- simdgroup matrices --------------------------------------------------------------------
// An 8x8 matrix spread over the 32 lanes, two consecutive elements of one row per lane:
// lane l holds row (q & 4) + (l / 2) % 4, columns (q & 2) * 2 + (l % 2) * 2 + {0, 1}, q = l / 4.
// Loads and stores are per lane (each lane moves its own two elements); multiply-accumulate is
// a simd operation: each lane gathers the rows and columns it needs from the others.

namespace detail {
inline void lane_cell(uint32_t lane, int& row, int& col) {
  const uint32_t q = lane / 4;
  row = int((q & 4) + (lane / 2) % 4);
  col = int((q & 2) * 2 + (lane % 2) * 2);
}
inline uint32_t cell_lane(int row, int col) {  // which lane holds (row, col); col & 1 picks
  static const auto table = [] {
    struct T { uint8_t lane[8][8]; } t{};
    for (uint32_t l = 0; l < 32; ++l) {
      int r, c;
      lane_cell(l, r, c);
      t.lane[r][c] = t.lane[r][c + 1] = uint8_t(l);
    }
    return t;
  }();
  return table.lane[row][col];
}
}  // namespace detail

template <class T, int R, int C>
struct simdgroup_matrix {
  static_assert(R == 8 && C == 8, "the emulator models 8x8 simdgroup matrices only");
  vec<T, 2> e;  // this lane's two elements
  vec<T, 2>& thread_elements() { return e; }
  const vec<T, 2>& thread_elements() const { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int R, int C>
inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, R, C> m;
  m.e = vec<T, 2>(value);
  return m;
}

// Element (i, j) of the loaded matrix is source row origin.y + i, column origin.x + j, or the
// transpose (row origin.y + j, column origin.x + i) when `transpose` is set.
template <class T, int R, int C, class U>
inline void simdgroup_load(simdgroup_matrix<T, R, C>& m, const U* src, ulong elements_per_row = C,
                           ulong2 origin = ulong2(0, 0), bool transpose = false) {
  int row, col;
  detail::lane_cell(mslemu::current_lane(), row, col);
  for (int k = 0; k < 2; ++k) {
    const ulong i = ulong(row), j = ulong(col + k);
    const ulong r = transpose ? j : i, c = transpose ? i : j;
    m.e[k] = T(src[(origin.y + r) * elements_per_row + origin.x + c]);
  }
}
template <class T, int R, int C, class U>
inline void simdgroup_store(const simdgroup_matrix<T, R, C>& m, U* dst, ulong elements_per_row = C,
                            ulong2 origin = ulong2(0, 0), bool transpose = false) {
  int row, col;
  detail::lane_cell(mslemu::current_lane(), row, col);
  for (int k = 0; k < 2; ++k) {
    const ulong i = ulong(row), j = ulong(col + k);
    const ulong r = transpose ? j : i, c = transpose ? i : j;
    dst[(origin.y + r) * elements_per_row + origin.x + c] = U(m.e[k]);
  }
}

namespace detail {
template <class T>
struct MmaLane { vec<T, 2> a, b, c; };
// All 64 cells of d = a * b + c, once per simdgroup: float accumulation over k in order, one
// fused multiply-add per term (Apple's order and rounding are not known: README).
template <class T>
MSLEMU_UNCHECKED void compute_mma(const mslemu::Gathered& g, void* out) {
  float a[8][8], b[8][8], c[8][8];
  for (uint32_t l = 0; l < uint32_t(mslemu::kSimdWidth); ++l) {
    const MmaLane<T> m = lane_value<MmaLane<T>>(g, l);
    int row, col;
    lane_cell(l, row, col);
    for (int k = 0; k < 2; ++k) {
      a[row][col + k] = float(m.a[k]);
      b[row][col + k] = float(m.b[k]);
      c[row][col + k] = float(m.c[k]);
    }
  }
  T d[8][8];
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) {
      float s = c[i][j];
      for (int k = 0; k < 8; ++k) s = __builtin_fmaf(a[i][k], b[k][j], s);
      d[i][j] = T(s);
    }
  memcpy(out, d, sizeof d);
}
}  // namespace detail

// d = a * b + c (8x8): a simd operation of the whole simdgroup.
template <class T, int M, int K, int N>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, M, N>& d, const simdgroup_matrix<T, M, K>& a,
                                          const simdgroup_matrix<T, K, N>& b,
                                          const simdgroup_matrix<T, M, N>& c,
                                          int line = __builtin_LINE()) {
  static_assert(sizeof(T[8][8]) <= mslemu::kSharedBytes, "matrix too large for the shared area");
  const detail::MmaLane<T> mine{a.e, b.e, c.e};
  const mslemu::Gathered g = detail::gather(mine, "simdgroup_multiply_accumulate", line);
  if (g.lanes != 0xffffffffu)
    mslemu::fail("simdgroup_multiply_accumulate with inactive lanes (mask %08x)", g.lanes);
  T cells[8][8];
  mslemu::simd_shared(g, cells, sizeof cells, &detail::compute_mma<T>);
  int row, col;
  detail::lane_cell(g.me, row, col);
  d.e = vec<T, 2>(cells[row][col], cells[row][col + 1]);
}
template <class T, int M, int K, int N>
inline void simdgroup_multiply(simdgroup_matrix<T, M, N>& d, const simdgroup_matrix<T, M, K>& a,
                               const simdgroup_matrix<T, K, N>& b, int line = __builtin_LINE()) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, M, N>(T(0)), line);
}

}  // namespace metal
using namespace metal;

typedef half float16_t;  // the names MLX's kernel utilities use
typedef bfloat bfloat16_t;

// The thread attributes an MLX kernel can take, by name (source.py writes the call).
namespace mslemu::attr {
inline uint3 u3(const uint32_t v[3]) { return uint3(v[0], v[1], v[2]); }
inline uint3 thread_position_in_grid(const Ids& id) { return u3(id.thread_position_in_grid); }
inline uint3 thread_position_in_threadgroup(const Ids& id) { return u3(id.thread_position_in_threadgroup); }
inline uint3 threadgroup_position_in_grid(const Ids& id) { return u3(id.threadgroup_position_in_grid); }
inline uint3 threads_per_threadgroup(const Ids& id) { return u3(id.threads_per_threadgroup); }
inline uint3 dispatch_threads_per_threadgroup(const Ids& id) { return u3(id.dispatch_threads_per_threadgroup); }
inline uint3 threadgroups_per_grid(const Ids& id) { return u3(id.threadgroups_per_grid); }
inline uint3 threads_per_grid(const Ids& id) { return u3(id.threads_per_grid); }
inline uint3 grid_size(const Ids& id) { return u3(id.threads_per_grid); }
inline uint thread_index_in_threadgroup(const Ids& id) { return id.thread_index_in_threadgroup; }
inline uint thread_index_in_simdgroup(const Ids& id) { return id.thread_index_in_simdgroup; }
inline uint simdgroup_index_in_threadgroup(const Ids& id) { return id.simdgroup_index_in_threadgroup; }
inline uint simdgroups_per_threadgroup(const Ids& id) { return id.simdgroups_per_threadgroup; }
inline uint dispatch_simdgroups_per_threadgroup(const Ids& id) { return id.simdgroups_per_threadgroup; }
inline uint threads_per_simdgroup(const Ids&) { return uint(kSimdWidth); }
inline uint thread_execution_width(const Ids&) { return uint(kSimdWidth); }
}  // namespace mslemu::attr

// Address spaces: nothing to the CPU (strict mode gives them meaning).
#define device
#define constant
#define thread
#define threadgroup
#define METAL_FUNC inline
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define FLT_MAX __FLT_MAX__
#define MAXFLOAT __FLT_MAX__
#define __METAL_VERSION__ 310
