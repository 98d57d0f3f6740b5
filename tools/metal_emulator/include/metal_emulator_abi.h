// The interface between an emulated kernel (compiled from its Metal source against
// metal_emulator.h) and the emulator's runtime (runtime/runtime.cpp): the GPU thread's ids, and
// the collective operations that make one GPU thread wait for others.
#pragma once
#include <stddef.h>
#include <stdint.h>

namespace mslemu {

constexpr int kSimdWidth = 32;     // Apple GPUs: 32 lanes per simdgroup
constexpr size_t kSlotBytes = 64;  // the largest value one lane can hand to a simd operation
constexpr size_t kSharedBytes = 256;  // the largest result a simd operation computes once for all

// One GPU thread's position, as the Metal attributes report it (see runtime.cpp's dispatch).
struct Ids {
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threads_per_threadgroup[3];           // this (possibly partial) threadgroup's size
  uint32_t dispatch_threads_per_threadgroup[3];  // the size the dispatch asked for
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
};

// The values every live lane of the caller's simdgroup handed to one simd operation: lane i's
// bytes at slots + i * kSlotBytes when bit i of `lanes` is set. Valid until the caller's next
// simd operation.
struct Gathered {
  const unsigned char* slots;
  uint32_t lanes;
  uint32_t me;
  int buffer;  // which of the simdgroup's two slot buffers (for simd_shared)
};

// The result of a simd operation that is the same for every lane (a reduction, a matrix
// product): the first lane to ask computes it with `compute(g, out)` into the simdgroup's shared
// area, every lane gets a copy of its first `size` bytes in `out`.
typedef void (*SharedCompute)(const Gathered& g, void* out);
void simd_shared(const Gathered& g, void* out, size_t size, SharedCompute compute);

// Blocks until every live lane of the simdgroup has called the same operation (`what`, at
// source line `line`); lanes that reach a different one are reported as divergent.
Gathered simd_gather(const void* value, size_t size, const char* what, int line);
// Blocks until every thread of the threadgroup has reached the same barrier.
void threadgroup_barrier(const char* what, int line);
// The threadgroup's array declared at `line` as `name` (one allocation per threadgroup, filled
// with 0xFF bytes so a read before any write shows; checked against Metal's 32 KiB).
void* threadgroup_alloc(const char* name, int line, size_t bytes, size_t align);
uint32_t current_lane();
[[noreturn]] void fail(const char* format, ...) __attribute__((format(printf, 1, 2)));

}  // namespace mslemu

// Defined by the generated entry of each emulated kernel.
extern "C" const int mslemu_buffer_count;
extern "C" void mslemu_kernel(void* const* buffers, const mslemu::Ids& id);
