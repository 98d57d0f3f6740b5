// The emulator's runtime: reads the kernel's buffers, dispatches the grid as MLX does
// (dispatchThreads: the grid counts threads, edge threadgroups may be partial), runs every GPU
// thread of a threadgroup as a fiber on one OS thread, and writes the outputs back.
//
// A fiber runs until it reaches a collective operation (a threadgroup barrier, a simd operation)
// and then yields; the last thread to arrive releases the others. So a threadgroup of 1024
// threads costs one OS thread and cheap user-space switches, and a barrier that some threads
// never reach is seen at once: nothing is left to run while some threads still wait (the
// divergence report names the operation, its source line and who arrived).
//
// Sanitizers: under AddressSanitizer each buffer and each threadgroup array is its own
// exact-size allocation, and the fiber switches are announced to ASan. Under ThreadSanitizer
// every fiber is a TSan fiber switched without implied synchronisation; barriers and simd
// operations release and acquire, so two GPU threads touching the same memory without a
// barrier between them are reported as a race. (This file itself is not TSan-instrumented:
// its bookkeeping is sequential per OS thread.)
//
// usage: kernel GX GY GZ TX TY TZ WORKERS (i|o):PATH...
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "metal_emulator_abi.h"

#if MSLEMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif
#if MSLEMU_TSAN
#include <sanitizer/tsan_interface.h>
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
#endif

namespace mslemu {

constexpr size_t kThreadgroupMemoryLimit = 32 * 1024;  // Apple GPUs: 32 KiB per threadgroup
constexpr uint32_t kMaxThreadsPerThreadgroup = 1024;
constexpr size_t kStackBytes = 256 * 1024;

[[noreturn]] void fail(const char* format, ...) {
  va_list args;
  va_start(args, format);
  fputs("metal-emulator: ", stderr);
  vfprintf(stderr, format, args);
  fputc('\n', stderr);
  va_end(args);
  fflush(stderr);
  _Exit(3);
}

}  // namespace mslemu

// ---- context switch ----------------------------------------------------------------------
// switch_stack(save, load): store the callee-saved registers and the stack pointer at *save,
// continue on the stack `load`. fiber_entry is where a fresh stack starts: fn(arg) from r13/r12.
extern "C" void mslemu_switch_stack(void** save, void* load);
extern "C" void mslemu_fiber_entry();
#if defined(__x86_64__)
asm(R"(
.text
.globl mslemu_switch_stack
.type mslemu_switch_stack,@function
mslemu_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size mslemu_switch_stack, .-mslemu_switch_stack
.globl mslemu_fiber_entry
.type mslemu_fiber_entry,@function
mslemu_fiber_entry:
  movq %r12, %rdi
  callq *%r13
  ud2
.size mslemu_fiber_entry, .-mslemu_fiber_entry
)");
#else
#error "metal-emulator: the fiber switch is written for x86-64 only"
#endif

namespace mslemu {
namespace {

struct Fiber;

// One pending collective: the threads that arrived and where they are.
struct Pending {
  int arrived = 0;
  int line = 0;
  const char* what = nullptr;
  uint32_t lanes = 0;
  std::vector<Fiber*> waiters;
};

struct Simdgroup {
  int live = 0;  // lanes that have not finished
  Pending pending;
  int phase = 0;  // simd operations completed: selects the slot buffer
  uint32_t lanes_done[2] = {0, 0};
  bool shared_ready[2] = {false, false};
  alignas(64) unsigned char slots[2][kSimdWidth][kSlotBytes];
  alignas(64) unsigned char shared[2][kSharedBytes];

  void reset(int lanes) {
    live = lanes;
    pending = Pending();
    phase = 0;
    shared_ready[0] = shared_ready[1] = false;
  }
};

struct Allocation {
  const char* name;
  int line;
  size_t bytes;
  void* data;
};

struct Fiber {
  void* sp = nullptr;
  unsigned char* stack = nullptr;  // usable stack (above a guard page)
  Ids ids{};
  int simd = 0;
  bool done = false;
  struct Worker* worker = nullptr;
  void* asan_fake_stack = nullptr;
  void* tsan = nullptr;
};

struct Worker {
  void* scheduler_sp = nullptr;
  const void* scheduler_stack = nullptr;  // for ASan's fiber annotations
  size_t scheduler_stack_size = 0;
  void* scheduler_tsan = nullptr;
  std::vector<Fiber> fibers;
  std::deque<Fiber*> ready;
  Fiber* current = nullptr;
  // the threadgroup being run
  uint32_t group[3] = {0, 0, 0};
  int total = 0;
  int finished = 0;
  Pending barrier;
  std::vector<Simdgroup> simd;
  std::vector<Allocation> arena;
  size_t arena_bytes = 0;
  char tsan_group_start = 0, tsan_group_end = 0;  // addresses to synchronise on
};

thread_local Worker* tls_worker = nullptr;

// The runtime's own memory traffic (its vectors' allocations, the lane slots it copies) goes
// through intercepted libc calls that TSan would see and pair up across fibers; this guard hides
// it for the current fiber. Kernel code never runs under it.
struct Untracked {
#if MSLEMU_TSAN
  Untracked() {
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  }
  ~Untracked() {
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  }
#endif
};
void* const* g_buffers = nullptr;

// ---- switching, with the sanitizers told -------------------------------------------------

void enter(Worker& w, Fiber* f) {  // scheduler -> fiber; back when no fiber is ready
  w.current = f;
#if MSLEMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f->stack, kStackBytes);
#endif
#if MSLEMU_TSAN
  __tsan_switch_to_fiber(f->tsan, __tsan_switch_to_fiber_no_sync);
#endif
  mslemu_switch_stack(&w.scheduler_sp, f->sp);
#if MSLEMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  w.current = nullptr;
}

// Fiber f stops (blocked, or finished for good): straight on to the next ready fiber, or back
// to the scheduler when none is ready (one switch per block, not two).
void leave(Fiber* f, bool finished) {
  Worker& w = *f->worker;
  Fiber* next = nullptr;
  {
    Untracked untracked;  // not across the switch: a finished fiber never comes back
    if (!w.ready.empty()) {
      next = w.ready.front();
      w.ready.pop_front();
    }
  }
  w.current = next;
#if MSLEMU_ASAN
  __sanitizer_start_switch_fiber(finished ? nullptr : &f->asan_fake_stack,
                                 next ? next->stack : w.scheduler_stack,
                                 next ? kStackBytes : w.scheduler_stack_size);
#endif
#if MSLEMU_TSAN
  __tsan_switch_to_fiber(next ? next->tsan : w.scheduler_tsan, __tsan_switch_to_fiber_no_sync);
#endif
  mslemu_switch_stack(&f->sp, next ? next->sp : w.scheduler_sp);
#if MSLEMU_ASAN
  __sanitizer_finish_switch_fiber(f->asan_fake_stack, nullptr, nullptr);
#endif
}

void release_sync(void* address) {
#if MSLEMU_TSAN
  __tsan_release(address);
#endif
  (void)address;
}
void acquire_sync(void* address) {
#if MSLEMU_TSAN
  __tsan_acquire(address);
#endif
  (void)address;
}

void wake(Worker& w, Pending& p) {
  for (Fiber* f : p.waiters) w.ready.push_back(f);
  p.waiters.clear();
  p.arrived = 0;
  p.lanes = 0;
  p.what = nullptr;
}

void complete_simd(Worker& w, Simdgroup& s) {
  s.lanes_done[s.phase & 1] = s.pending.lanes;
  s.shared_ready[s.phase & 1] = false;
  ++s.phase;
  wake(w, s.pending);
}

// Record an arrival at `p`; a different operation or line than the others' is divergence.
void arrive(Worker& w, Pending& p, const char* what, int line, const char* scope) {
  if (p.arrived == 0) {
    p.what = what;
    p.line = line;
  } else if (p.line != line || (p.what != what && strcmp(p.what, what) != 0)) {
    fail("threadgroup (%u,%u,%u) thread %u: divergent %s: it reached %s at line %d while %d "
         "other thread(s) wait at %s at line %d",
         w.group[0], w.group[1], w.group[2], w.current->ids.thread_index_in_threadgroup, scope,
         what, line, p.arrived, p.what, p.line);
  }
  ++p.arrived;
}

void block(Worker& w, Pending& p) {
  Fiber* f = w.current;
  p.waiters.push_back(f);
  leave(f, false);
}

[[noreturn]] void report_deadlock(Worker& w) {
  std::string why;
  char line[256];
  if (w.barrier.arrived) {
    snprintf(line, sizeof line, "; %s at line %d: %d of %d threads arrived, %d finished without it",
             w.barrier.what, w.barrier.line, w.barrier.arrived, w.total, w.finished);
    why += line;
  }
  for (size_t i = 0; i < w.simd.size(); ++i) {
    const Pending& p = w.simd[i].pending;
    if (!p.arrived) continue;
    snprintf(line, sizeof line, "; simdgroup %zu: %s at line %d: %d of %d live lanes arrived", i,
             p.what, p.line, p.arrived, w.simd[i].live);
    why += line;
  }
  fail("threadgroup (%u,%u,%u): divergent control flow: threads wait at operations the others "
       "never reach%s",
       w.group[0], w.group[1], w.group[2], why.c_str());
}

void finish_thread(Fiber* f) {
  Worker& w = *f->worker;
  f->done = true;
  ++w.finished;
  Simdgroup& s = w.simd[f->simd];
  --s.live;
  if (s.pending.arrived > 0 && s.pending.arrived == s.live) complete_simd(w, s);
  release_sync(&w.tsan_group_end);
}

void fiber_main(Fiber* f) {
#if MSLEMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  acquire_sync(&f->worker->tsan_group_start);
  mslemu_kernel(g_buffers, f->ids);
  {
    Untracked untracked;
    finish_thread(f);
  }
  leave(f, true);
  fail("a finished GPU thread was resumed");
}

// A fresh stack frame that starts fiber_main(f) at the next switch into f (see the asm).
void arm(Fiber* f) {
  if (!f->stack) {
    const long page = sysconf(_SC_PAGESIZE);
    void* m = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) fail("cannot map a fiber stack");
    mprotect(m, page, PROT_NONE);  // guard page: a stack overflow faults
    f->stack = static_cast<unsigned char*>(m) + page;
#if MSLEMU_TSAN
    f->tsan = __tsan_create_fiber(0);
#endif
  }
  uint64_t* top = reinterpret_cast<uint64_t*>(f->stack + kStackBytes);
  top[-1] = reinterpret_cast<uint64_t>(&mslemu_fiber_entry);  // return address
  top[-2] = 0;                                                // rbp
  top[-3] = 0;                                                // rbx
  top[-4] = reinterpret_cast<uint64_t>(f);                    // r12: argument
  top[-5] = reinterpret_cast<uint64_t>(&fiber_main);          // r13: function
  top[-6] = 0;                                                // r14
  top[-7] = 0;                                                // r15
  top[-8] = 0x037F00001F80ull;                                // x87 control word, mxcsr
  f->sp = &top[-8];
  f->done = false;
}

// ---- dispatch ----------------------------------------------------------------------------

struct Dispatch {
  uint32_t grid[3], tg[3], groups[3];
  uint64_t group_count;
};

void set_ids(Ids& id, const Dispatch& d, const uint32_t g[3], const uint32_t n[3], uint32_t t) {
  const uint32_t local[3] = {t % n[0], (t / n[0]) % n[1], t / (n[0] * n[1])};
  for (int a = 0; a < 3; ++a) {
    id.thread_position_in_threadgroup[a] = local[a];
    id.threadgroup_position_in_grid[a] = g[a];
    id.thread_position_in_grid[a] = g[a] * d.tg[a] + local[a];
    id.threads_per_threadgroup[a] = n[a];
    id.dispatch_threads_per_threadgroup[a] = d.tg[a];
    id.threadgroups_per_grid[a] = d.groups[a];
    id.threads_per_grid[a] = d.grid[a];
  }
  id.thread_index_in_threadgroup = t;
  id.thread_index_in_simdgroup = t % kSimdWidth;
  id.simdgroup_index_in_threadgroup = t / kSimdWidth;
}

void run_group(Worker& w, const Dispatch& d, uint64_t index) {
  const uint32_t g[3] = {uint32_t(index % d.groups[0]), uint32_t(index / d.groups[0] % d.groups[1]),
                         uint32_t(index / (uint64_t(d.groups[0]) * d.groups[1]))};
  uint32_t n[3];
  for (int a = 0; a < 3; ++a) n[a] = std::min(d.tg[a], d.grid[a] - g[a] * d.tg[a]);
  const int total = int(n[0] * n[1] * n[2]);
  const int simds = (total + kSimdWidth - 1) / kSimdWidth;
  memcpy(w.group, g, sizeof g);
  w.total = total;
  w.finished = 0;
  w.simd.resize(simds);
  for (int s = 0; s < simds; ++s) w.simd[s].reset(std::min(kSimdWidth, total - s * kSimdWidth));
  if (int(w.fibers.size()) < total) w.fibers.resize(total);
  release_sync(&w.tsan_group_start);
  for (int t = 0; t < total; ++t) {
    Fiber* f = &w.fibers[t];
    f->worker = &w;
    f->simd = t / kSimdWidth;
    set_ids(f->ids, d, g, n, t);
    f->ids.simdgroups_per_threadgroup = simds;
    arm(f);
    w.ready.push_back(f);
  }
  while (!w.ready.empty()) {
    Fiber* f = w.ready.front();
    w.ready.pop_front();
    enter(w, f);
  }
  if (w.finished != total) report_deadlock(w);
  acquire_sync(&w.tsan_group_end);
  for (Allocation& a : w.arena) free(a.data);
  w.arena.clear();
  w.arena_bytes = 0;
}

void run_worker(const Dispatch& d, std::atomic<uint64_t>& next) {
  Untracked untracked;
  Worker w;
  tls_worker = &w;
  pthread_attr_t attr;  // this OS thread's stack, for ASan's fiber annotations
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    void* base;
    pthread_attr_getstack(&attr, &base, &w.scheduler_stack_size);
    w.scheduler_stack = base;
    pthread_attr_destroy(&attr);
  }
#if MSLEMU_TSAN
  w.scheduler_tsan = __tsan_get_current_fiber();
#endif
  for (uint64_t i = next++; i < d.group_count; i = next++) run_group(w, d, i);
#if MSLEMU_TSAN
  for (Fiber& f : w.fibers)
    if (f.tsan) __tsan_destroy_fiber(f.tsan);
#endif
  tls_worker = nullptr;
}

}  // namespace

// ---- the collective operations (metal_emulator_abi.h) ------------------------------------

Gathered simd_gather(const void* value, size_t size, const char* what, int line) {
  Untracked untracked;
  Worker& w = *tls_worker;
  Fiber* f = w.current;
  Simdgroup& s = w.simd[f->simd];
  const uint32_t lane = f->ids.thread_index_in_simdgroup;
  const int buffer = s.phase & 1;
  if (size > kSlotBytes) fail("%s: a %zu-byte value is larger than a lane slot", what, size);
  arrive(w, s.pending, what, line, "simd operation");
  if (size) memcpy(s.slots[buffer][lane], value, size);
  s.pending.lanes |= 1u << lane;
  release_sync(&s.pending);
  if (s.pending.arrived == s.live) complete_simd(w, s);
  else block(w, s.pending);
  acquire_sync(&s.pending);
  return Gathered{&s.slots[buffer][0][0], s.lanes_done[buffer], lane, buffer};
}

void simd_shared(const Gathered& g, void* out, size_t size, SharedCompute compute) {
  Untracked untracked;
  Worker& w = *tls_worker;
  Simdgroup& s = w.simd[w.current->simd];
  if (size > kSharedBytes) fail("a simd result of %zu bytes is larger than the shared area", size);
  if (!s.shared_ready[g.buffer]) {
    compute(g, s.shared[g.buffer]);
    s.shared_ready[g.buffer] = true;
  }
  memcpy(out, s.shared[g.buffer], size);
}

void threadgroup_barrier(const char* what, int line) {
  Untracked untracked;
  Worker& w = *tls_worker;
  arrive(w, w.barrier, what, line, "barrier");
  release_sync(&w.barrier);
  if (w.barrier.arrived == w.total) wake(w, w.barrier);
  else block(w, w.barrier);
  acquire_sync(&w.barrier);
}

void* threadgroup_alloc(const char* name, int line, size_t bytes, size_t align) {
  Untracked untracked;
  Worker& w = *tls_worker;
  for (Allocation& a : w.arena)
    if (a.line == line && strcmp(a.name, name) == 0) return a.data;
  w.arena_bytes += bytes;
  if (w.arena_bytes > kThreadgroupMemoryLimit)
    fail("threadgroup memory: %zu bytes declared (%s at line %d brings it over), Metal's limit "
         "is %zu",
         w.arena_bytes, name, line, kThreadgroupMemoryLimit);
  void* data = aligned_alloc(std::max<size_t>(align, 16), (bytes + 15) / 16 * 16);
  if (!data) fail("out of memory for threadgroup array %s", name);
  memset(data, 0xFF, bytes);  // uninitialised threadgroup memory reads as NaN / all ones
  w.arena.push_back(Allocation{name, line, bytes, data});
  return data;
}

uint32_t current_lane() { return tls_worker->current->ids.thread_index_in_simdgroup; }

}  // namespace mslemu

// ---- main: buffers in, dispatch, outputs out ---------------------------------------------

namespace {

struct Buffer {
  std::string path;
  bool output;
  size_t bytes;
  void* data;
};

Buffer read_buffer(const char* spec) {
  if ((spec[0] != 'i' && spec[0] != 'o') || spec[1] != ':')
    mslemu::fail("buffer argument %s is not i:PATH or o:PATH", spec);
  Buffer b{spec + 2, spec[0] == 'o', 0, nullptr};
  const int fd = open(b.path.c_str(), O_RDONLY);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) mslemu::fail("cannot read buffer file %s", b.path.c_str());
  b.bytes = size_t(st.st_size);
  b.data = malloc(b.bytes ? b.bytes : 1);  // exact size: ASan sees any access past the end
  for (size_t done = 0; done < b.bytes;) {
    const ssize_t got = read(fd, static_cast<char*>(b.data) + done, b.bytes - done);
    if (got <= 0) mslemu::fail("short read of %s", b.path.c_str());
    done += size_t(got);
  }
  close(fd);
  return b;
}

void write_buffer(const Buffer& b) {
  const int fd = open(b.path.c_str(), O_WRONLY | O_TRUNC);
  if (fd < 0) mslemu::fail("cannot write buffer file %s", b.path.c_str());
  for (size_t done = 0; done < b.bytes;) {
    const ssize_t put = write(fd, static_cast<const char*>(b.data) + done, b.bytes - done);
    if (put <= 0) mslemu::fail("short write of %s", b.path.c_str());
    done += size_t(put);
  }
  close(fd);
}

mslemu::Dispatch parse_dispatch(char** argv) {
  mslemu::Dispatch d{};
  d.group_count = 1;
  uint64_t threads = 1;
  for (int a = 0; a < 3; ++a) {
    d.grid[a] = uint32_t(strtoul(argv[1 + a], nullptr, 10));
    d.tg[a] = uint32_t(strtoul(argv[4 + a], nullptr, 10));
    if (d.grid[a] == 0 || d.tg[a] == 0) mslemu::fail("grid and threadgroup sizes must be positive");
    d.groups[a] = (d.grid[a] + d.tg[a] - 1) / d.tg[a];
    d.group_count *= d.groups[a];
    threads *= d.tg[a];
  }
  if (threads > mslemu::kMaxThreadsPerThreadgroup)
    mslemu::fail("threadgroup of %llu threads: Metal allows at most %u",
                 (unsigned long long)threads, mslemu::kMaxThreadsPerThreadgroup);
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 8) mslemu::fail("usage: %s GX GY GZ TX TY TZ WORKERS (i|o):PATH...", argv[0]);
  const mslemu::Dispatch d = parse_dispatch(argv);
  const int workers = std::max(1, atoi(argv[7]));
  if (argc - 8 != mslemu_buffer_count)
    mslemu::fail("the kernel takes %d buffers, %d given", mslemu_buffer_count, argc - 8);
  std::vector<Buffer> buffers;
  std::vector<void*> pointers;
  for (int i = 8; i < argc; ++i) {
    buffers.push_back(read_buffer(argv[i]));
    pointers.push_back(buffers.back().data);
  }
  mslemu::g_buffers = pointers.data();
  std::atomic<uint64_t> next{0};
  std::vector<std::thread> extra;
  for (int i = 1; i < workers && uint64_t(i) < d.group_count; ++i)
    extra.emplace_back([&] { mslemu::run_worker(d, next); });
  mslemu::run_worker(d, next);
  for (std::thread& t : extra) t.join();
  for (Buffer& b : buffers) {
    if (b.output) write_buffer(b);
    free(b.data);
  }
  return 0;
}
