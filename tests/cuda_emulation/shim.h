// Host emulation of the parts of CUDA the kernels in csrc/*.cu use, for
// tests/test_cuda_emulation.py: every CUDA thread of a block is a fiber (ucontext), and one
// OS thread runs them all, so the emulation does not depend on how the OS schedules threads.
//
// - Blocks run one after another. The `threads` fibers of a launch, each with its own heap
//   stack, are switched round-robin: a fiber runs until it waits at a barrier or finishes the
//   block. __syncthreads is a barrier over the block, a warp shuffle exchanges values through
//   a per-warp buffer and one barrier over the warp; a fiber that arrives at a barrier and is
//   not the last yields until the barrier's generation moves.
// - threadIdx and the warp context are plain globals, set whenever a fiber is switched in.
// - A thread that returns early drops out of its block's and its warp's barriers, as an
//   exited CUDA thread no longer takes part in __syncthreads.
// - If every live thread of a block waits at a barrier that cannot complete (a deadlock on a
//   GPU), the launch aborts with a message naming the launch and the block.
// - Dynamic shared memory is one buffer per launch, filled with NaN before every block, so
//   a read of it that no thread of the block has written shows up as NaN.
// - Fiber switches are announced to AddressSanitizer, which otherwise mistakes the fiber
//   stacks for overflows of the OS thread's stack.
// - Only what the kernels use is here: fp16 (through the compiler's _Float16) and bf16
//   conversions rounding to nearest even, fmaf, __fmul_rn and the math of <cmath>. Memory ordering
//   and atomics are not modelled (the kernels use none).
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define CUDA_EMULATION_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CUDA_EMULATION_ASAN 1
#endif
#endif
#ifdef CUDA_EMULATION_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
// One OS thread runs every fiber, so these are globals: threadIdx and t_warp are set each
// time a fiber is switched in, blockIdx and t_smem before each block.
inline dim3 threadIdx, blockIdx;
inline dim3 gridDim, blockDim;

namespace cuda_emulation {
struct Barrier {
  unsigned expected = 0, arrived = 0;  // expected: the live threads it waits for
  uint64_t generation = 0;             // moves each time every expected thread has arrived
  void complete() {
    arrived = 0;
    ++generation;
  }
};
}  // namespace cuda_emulation
struct WarpCtx {
  cuda_emulation::Barrier* bar;
  float* buf;  // 2 x 32 floats, one per lane
};
inline WarpCtx t_warp;
inline float* t_smem;  // the launch's dynamic shared memory

namespace cuda_emulation {
constexpr int kMain = -1;  // the launch's own context, on the OS thread's stack
// Per fiber; the kernels' locals are a few KiB at most, the rest leaves room for ASan's
// redzones and for its error reports, which run on the faulting fiber's stack.
constexpr size_t kStackBytes = 256 * 1024;

struct Fiber {
  ucontext_t ctx;
  const Barrier* wait = nullptr;  // the barrier it waits at, until its generation moves
  uint64_t wait_gen = 0;
  bool done = false;  // returned from the kernel in this block
  bool runnable() const { return !done && (!wait || wait->generation != wait_gen); }
};

struct Launch {
  const char* name = nullptr;  // launch<F>'s __PRETTY_FUNCTION__: F names the launcher
  unsigned long long number = 0;
  unsigned threads = 0, live = 0;
  void (*body)(void*) = nullptr;  // the kernel body bound to its arguments
  void* arg = nullptr;
  std::unique_ptr<Fiber[]> fibers;
  ucontext_t main_ctx{};
  Barrier block_bar;
  std::vector<Barrier> warp_bar;
  std::vector<float> warp_buf;
  int cur = kMain, from = kMain;
  bool quit = false;
  const void* main_stack = nullptr;
  size_t main_stack_size = 0;
};
inline Launch* g_launch;
inline unsigned long long g_launches;
// kStackBytes per fiber, kept for later launches; separate allocations, so that ASan's heap
// redzones lie between them and catch a fiber overflowing its stack
inline std::vector<std::unique_ptr<char[]>> g_stacks;

inline void switch_to(Launch& L, int to, bool exiting = false) {
  const int from = L.cur;
  L.from = from;
  L.cur = to;
  if (to != kMain) {
    threadIdx = dim3(to);
    t_warp = WarpCtx{&L.warp_bar[to / 32], &L.warp_buf[to / 32 * 64]};
  }
  ucontext_t* src = from == kMain ? &L.main_ctx : &L.fibers[from].ctx;
  ucontext_t* dst = to == kMain ? &L.main_ctx : &L.fibers[to].ctx;
#ifdef CUDA_EMULATION_ASAN
  // an exiting fiber passes no fake-stack slot, so ASan frees its fake stack
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(exiting ? nullptr : &fake_stack,
                                 to == kMain ? L.main_stack : g_stacks[to].get(),
                                 to == kMain ? L.main_stack_size : kStackBytes);
#endif
  swapcontext(src, dst);
#ifdef CUDA_EMULATION_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
}

[[noreturn]] inline void deadlock(const Launch& L) {
  const char* f = std::strstr(L.name, "F = ");
  const char* f_end = f ? std::strpbrk(f, ";]") : nullptr;
  std::fprintf(stderr,
               "cuda emulation: deadlock in launch #%llu (%.*s), block (%u, %u, %u) of grid (%u, %u, %u): "
               "each of its %u live threads waits at a barrier that the others do not reach\n",
               L.number, f && f_end ? int(f_end - f - 4) : int(std::strlen(L.name)), f && f_end ? f + 4 : L.name,
               blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, gridDim.z, L.live);
  std::fprintf(stderr, "  __syncthreads: %u of %u live threads arrived\n", L.block_bar.arrived, L.block_bar.expected);
  for (size_t w = 0; w < L.warp_bar.size(); ++w) {
    if (L.warp_bar[w].arrived) {
      std::fprintf(stderr, "  warp %zu's shuffle: %u of %u live lanes arrived\n", w, L.warp_bar[w].arrived,
                   L.warp_bar[w].expected);
    }
  }
  std::fprintf(stderr, "  %u of %u threads have returned\n", L.threads - L.live, L.threads);
  std::fflush(stderr);
  std::abort();
}

// Switches to the next runnable fiber after the current one, round-robin; back to the
// launch once the block's fibers are all done. Returns when the current fiber runs again.
inline void schedule(Launch& L) {
  const int self = L.cur, n = static_cast<int>(L.threads);
  for (int k = 1; k <= n; ++k) {
    const int j = (self + k) % n;
    if (!L.fibers[j].runnable()) continue;
    if (j != self) switch_to(L, j);
    L.fibers[self].wait = nullptr;
    return;
  }
  if (L.live > 0) deadlock(L);
  switch_to(L, kMain);
  L.fibers[self].wait = nullptr;
}

inline void arrive_and_wait(Barrier& b) {
  Launch& L = *g_launch;
  if (++b.arrived == b.expected) {
    b.complete();
    return;
  }
  Fiber& f = L.fibers[L.cur];
  f.wait = &b;
  f.wait_gen = b.generation;
  schedule(L);
}

inline void arrive_and_drop(Barrier& b) {  // a thread that returned: the barrier stops waiting for it
  --b.expected;
  if (b.arrived > 0 && b.arrived == b.expected) b.complete();
}

// Every fiber runs the kernel body once per block, then waits for the next block or the
// end of the launch.
inline void fiber_main() {
  Launch& L = *g_launch;
#ifdef CUDA_EMULATION_ASAN
  const void* from_stack;
  size_t from_size;
  __sanitizer_finish_switch_fiber(nullptr, &from_stack, &from_size);
  if (L.from == kMain) {
    L.main_stack = from_stack;
    L.main_stack_size = from_size;
  }
#endif
  while (!L.quit) {
    L.body(L.arg);
    const int t = L.cur;
    arrive_and_drop(L.block_bar);
    arrive_and_drop(L.warp_bar[t / 32]);
    L.fibers[t].done = true;
    --L.live;
    schedule(L);
  }
  switch_to(L, kMain, /*exiting=*/true);  // never resumed
}
}  // namespace cuda_emulation

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
// Static __shared__ arrays: one per kernel instantiation, shared by every thread (blocks run
// one at a time). `extern __shared__` (dynamic) declarations are rewritten by the test to
// point at the launch's buffer, t_smem.
#define __shared__ static

inline void __syncthreads() { cuda_emulation::arrive_and_wait(cuda_emulation::g_launch->block_bar); }
// a product rounded on its own, never contracted into an FMA (the volatile store forces it)
inline float __fmul_rn(float a, float b) {
  volatile float p = a * b;
  return p;
}
// One barrier per shuffle: phases alternate between the warp buffer's two halves, and no
// lane can start the phase after next (overwriting this half) before every lane has read it.
inline float __shfl_sync(unsigned, float v, int src) {
  float* buf = t_warp.buf + 32 * (t_warp.bar->generation & 1);
  buf[threadIdx.x % 32] = v;
  cuda_emulation::arrive_and_wait(*t_warp.bar);
  return buf[src & 31];
}
inline float __shfl_xor_sync(unsigned, float v, int o) {
  const int lane = threadIdx.x % 32;
  float* buf = t_warp.buf + 32 * (t_warp.bar->generation & 1);
  buf[lane] = v;
  cuda_emulation::arrive_and_wait(*t_warp.bar);
  return buf[(lane ^ o) & 31];
}

struct __half {
  uint16_t x;
};
struct __nv_bfloat16 {
  uint16_t x;
};
inline float __half2float(__half h) {
  _Float16 v;
  std::memcpy(&v, &h.x, 2);
  return static_cast<float>(v);
}
inline __half __float2half_rn(float f) {
  const _Float16 v = static_cast<_Float16>(f);
  __half h;
  std::memcpy(&h.x, &v, 2);
  return h;
}
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = uint32_t(b.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return __nv_bfloat16{uint16_t(u >> 16)};
}
typedef struct CUstream_st* cudaStream_t;

// The runtime calls of the launchers. Launches run synchronously and cannot fail here;
// opting a kernel into more than 48 KiB of dynamic shared memory fails above the smallest
// limit of the supported GPUs (sm_80: 163 KiB), as cudaFuncSetAttribute would there.
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "invalid argument"; }
template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel, cudaFuncAttribute, int bytes) {
  return bytes <= 163 * 1024 ? cudaSuccess : cudaErrorInvalidValue;
}

// Runs fn (the kernel body bound to its arguments) for every block of grid, with `threads`
// threads per block and smem_bytes of shared memory.
template <typename F>
void launch(dim3 grid, unsigned threads, size_t smem_bytes, F fn) {
  using namespace cuda_emulation;
  gridDim = grid;
  blockDim = dim3(threads);
  const unsigned n_warps = (threads + 31) / 32;
  const unsigned n_blocks = grid.x * grid.y * grid.z;
  if (n_blocks == 0 || threads == 0) return;
  if (g_launch) {
    std::fprintf(stderr, "cuda emulation: launch from inside a kernel\n");
    std::abort();
  }
  std::vector<float> smem(smem_bytes / 4 + 1);
  Launch L;
  L.name = __PRETTY_FUNCTION__;
  L.number = ++g_launches;
  L.threads = threads;
  L.body = [](void* f) { (*static_cast<F*>(f))(); };
  L.arg = &fn;
  L.fibers = std::make_unique<Fiber[]>(threads);
  L.warp_bar.resize(n_warps);
  L.warp_buf.assign(size_t(n_warps) * 64, 0.0f);
  while (g_stacks.size() < threads) g_stacks.emplace_back(new char[kStackBytes]);
  for (unsigned t = 0; t < threads; ++t) {
#ifdef CUDA_EMULATION_ASAN
    // an earlier launch's fiber left the poisoned redzones of the frames it never returned from
    __asan_unpoison_memory_region(g_stacks[t].get(), kStackBytes);
#endif
    ucontext_t& c = L.fibers[t].ctx;
    getcontext(&c);
    c.uc_stack.ss_sp = g_stacks[t].get();
    c.uc_stack.ss_size = kStackBytes;
    c.uc_link = nullptr;
    makecontext(&c, fiber_main, 0);
    // swapcontext only needs the registers makecontext set. ASan's swapcontext clears the
    // shadow of the target's uc_stack, which would erase the redzones of the suspended frames.
    c.uc_stack.ss_sp = nullptr;
    c.uc_stack.ss_size = 0;
  }
  g_launch = &L;
  for (unsigned b = 0; b < n_blocks; ++b) {
    std::fill(smem.begin(), smem.end(), std::nanf(""));
    blockIdx = dim3(b % grid.x, (b / grid.x) % grid.y, b / (grid.x * grid.y));
    t_smem = smem.data();
    L.block_bar = Barrier{threads};  // fresh: a previous block's early exits lowered the counts
    for (unsigned w = 0; w < n_warps; ++w) L.warp_bar[w] = Barrier{std::min(32u, threads - 32 * w)};
    for (unsigned t = 0; t < threads; ++t) L.fibers[t].done = false;
    L.live = threads;
    switch_to(L, 0);
  }
  L.quit = true;  // let every fiber leave fiber_main, so ASan frees its fake stack
  for (unsigned t = 0; t < threads; ++t) switch_to(L, static_cast<int>(t));
  g_launch = nullptr;
}
