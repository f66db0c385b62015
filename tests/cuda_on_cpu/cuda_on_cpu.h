// cuda_on_cpu.h: run CUDA C kernels on the CPU, one OS thread per CUDA thread of a block.
//
// This is a test harness for commopt's kernels in cuda/, not a CUDA implementation. The loader
// (tests/cuda_on_cpu/__init__.py) compiles the exact text CuPy gets (cuda_source()) with g++,
// this header first and one CUDA_ON_CPU_EXPORT(kernel) line per `extern "C" __global__` entry
// after it. What each CUDA construct becomes:
//
//   threadIdx, blockIdx     thread_local per OS thread; blockDim, gridDim: set per launch.
//   a launch <<<grid,block>>> blockDim.x·y·z OS threads (std::thread), started per launch. They
//                           run the blocks one after another, in blockIdx order (x fastest;
//                           with jitter, in a random order, so the last block to finish is not
//                           always the highest one), and meet at a barrier after each block.
//                           Launches are serialised.
//   __global__              nothing (the entries are already extern "C" void functions).
//   __device__              static inline.
//   __shared__              static: one copy, reused by every block in turn (blocks never run
//                           at the same time); like a GPU, it is not cleared between blocks.
//   __syncthreads()         a barrier of the block's threads that have not returned yet
//                           (a returned thread leaves the block's barriers, as on sm_70+).
//   warps                   threads 32w..32w+31 of the block's linear thread index.
//   __shfl_down_sync(m,v,d) a barrier of the warp's live lanes that also exchanges v: lane l
//                           gets lane l+d's v, or its own when l+d > 31. One barrier per call
//                           (values double-buffered by barrier generation).
//   __ballot_sync(m,p)      the same barrier; bit l of the result is lane l's p.
//   __brev(x)               32-bit bit reversal.
//   float4, make_float4     a 16-byte-aligned struct of four floats; a vector access through a
//                           float4* that is not 16-byte aligned aborts (the loader builds with
//                           -fsanitize=alignment), as it faults on a GPU.
//   atomicAdd(unsigned*, v) __atomic_fetch_add (sequentially consistent).
//   __threadfence()         a sequentially consistent fence.
//   __fadd_rn, __fsub_rn,   plain float +, -, *, /: IEEE-754 binary32, round to nearest even
//   __fmul_rn, __fdiv_rn    on x86-64 SSE; the loader passes -ffp-contract=off, so g++ never
//                           fuses a multiply and an add (the CUDA intrinsics forbid that too).
//   __double2float_rn(d)    (float)d: one correctly rounded conversion. sqrt: IEEE sqrt.
//
// What it checks that a GPU would not report: a warp intrinsic whose mask names a lane that
// did not take part (it returned, diverged, or does not exist), and lanes of one warp meeting
// at different warp intrinsics (source lines differ; CUDA allows that with partial masks,
// commopt's kernels never do it). Either makes the launch return an error, which the loader
// raises. A barrier that waits longer than CUDA_ON_CPU_TIMEOUT_S seconds (default 300) aborts
// the process with a message: a deadlock fails loudly, never hangs CI.
//
// -DCUDA_ON_CPU_FIBERS=1 swaps the scheduler, nothing else: the block's CUDA threads become
// ucontext fibers on the launching OS thread, each running until it waits at a barrier, then
// the next runnable one is resumed (in thread order; in random order with jitter). Same
// barriers, same checks, ~18x less CPU time (a barrier costs a user-space switch per
// thread, not an OS context switch), deterministic, and a deadlock is reported at once. The
// broad randomised sweeps use it; the OS-thread scheduler is the model the issue asks for.
//
// Randomised scheduling: with -DCUDA_ON_CPU_JITTER=1, every thread yields or sleeps (up to
// 200 µs) at random, seeded by cuda_on_cpu_seed(), at each block start, before and after every
// barrier and warp intrinsic (fibers: yields to a scheduler that picks at random). A kernel
// that is correct only because threads happened to run in order (a missing __syncthreads)
// then gives wrong results.
//
// Not modelled: warp-synchronous code without *_sync intrinsics, atomics other than
// atomicAdd on unsigned int, memory ordering weaker than x86's (a missing __threadfence goes
// unnoticed), dynamic shared
// memory, cooperative groups, textures, streams (a launch runs to completion before returning).
#pragma once

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef CUDA_ON_CPU_JITTER
#define CUDA_ON_CPU_JITTER 0
#endif
#ifndef CUDA_ON_CPU_FIBERS
#define CUDA_ON_CPU_FIBERS 0
#endif
#if CUDA_ON_CPU_FIBERS
#include <ucontext.h>
#endif

namespace cuda_on_cpu {

struct uint3 {
    unsigned int x, y, z;
};

}  // namespace cuda_on_cpu

inline thread_local cuda_on_cpu::uint3 threadIdx, blockIdx;
inline cuda_on_cpu::uint3 blockDim, gridDim;

#define __global__
#define __device__ static inline
#define __shared__ static
#define __forceinline__  // __device__ already makes it inline

using std::sqrt;

namespace cuda_on_cpu {

inline thread_local unsigned warp_index, lane_index;
inline unsigned jitter_seed = 0;

#if CUDA_ON_CPU_FIBERS
// Every CUDA thread of the block is a ucontext fiber on the launching OS thread. A fiber runs
// until it must wait (a barrier whose generation has not moved on) or, with jitter, yields;
// then the scheduler in run() resumes the next runnable fiber.
struct Fiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    const std::atomic<uint32_t>* waiting_on = nullptr;  // runnable once *waiting_on != gen
    uint32_t waiting_gen = 0;
    bool finished = false;
    uint3 thread_idx{}, block_idx{};
    unsigned warp = 0, lane = 0;
    std::minstd_rand rng;
};
inline Fiber* running = nullptr;
inline ucontext_t scheduler_context;

inline void suspend(const std::atomic<uint32_t>* on, uint32_t gen) {
    running->waiting_on = on;
    running->waiting_gen = gen;
    swapcontext(&running->context, &scheduler_context);
}
#endif

#if CUDA_ON_CPU_JITTER
inline thread_local std::minstd_rand jitter_rng;
inline void jitter() {
#if CUDA_ON_CPU_FIBERS
    if (jitter_rng() % 4 == 0) suspend(nullptr, 0);  // the scheduler's order is random too
#else
    const unsigned r = jitter_rng() % 16;
    if (r == 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(jitter_rng() % 200));
    } else if (r < 6) {
        sched_yield();
    }
#endif
}
#else
inline void jitter() {}
#endif

inline double timeout_seconds() {
    const char* text = std::getenv("CUDA_ON_CPU_TIMEOUT_S");
    return text ? std::atof(text) : 300.0;
}

// Threads that meet: a block (lane < 0 at arrival) or a warp (lanes carry values).
struct Group {
    std::mutex m;
    unsigned expected = 0;  // members that have not returned from the kernel in this block
    unsigned arrived = 0;
    std::atomic<uint32_t> gen{0};
    uint32_t members = 0;     // bit l: lane l exists (warps only)
    uint32_t arrived_set[2];  // double-buffered by gen & 1, with the fields below
    uint64_t value[2][32];
    uint32_t mask[2][32];
    int line[2][32];
};

struct Launch {
    unsigned nthreads = 0;
    Group block;
    std::vector<Group> warps;
    Group end;  // after each block: everyone, nobody leaves
    std::vector<unsigned long long> order;  // the blocks' linear indices, in the order run
    std::mutex error_m;
    std::string error;

    void fail(const std::string& message) {
        std::lock_guard<std::mutex> lock(error_m);
        if (error.empty()) error = message;
    }
};

inline Launch* current = nullptr;
inline std::mutex launch_mutex;

inline void wait_generation(Group& g, uint32_t gen, const char* what) {
#if CUDA_ON_CPU_FIBERS
    (void)what;  // no timeout needed: run() reports a deadlock as soon as nothing can run
    while (g.gen.load(std::memory_order_acquire) == gen) suspend(&g.gen, gen);
#else
    const auto start = std::chrono::steady_clock::now();
    const double limit = timeout_seconds();
    while (g.gen.load(std::memory_order_acquire) == gen) {
        timespec ts{1, 0};
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&g.gen), FUTEX_WAIT_PRIVATE, gen, &ts,
                nullptr, 0);
        if (g.gen.load(std::memory_order_acquire) != gen) break;
        const double waited =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (waited >= limit) {
            std::fprintf(stderr,
                         "cuda_on_cpu: deadlock: thread (%u,%u,%u) of block (%u,%u,%u) waited "
                         "%.0f s at %s\n",
                         threadIdx.x, threadIdx.y, threadIdx.z, blockIdx.x, blockIdx.y,
                         blockIdx.z, waited, what);
            std::abort();
        }
    }
#endif
}

// Called with g.m held once every expected member has arrived.
inline void release_locked(Group& g, bool is_warp) {
    const int p = g.gen.load(std::memory_order_relaxed) & 1;
    if (is_warp && g.arrived > 0) {
        const uint32_t present = g.arrived_set[p];
        int first = -1;
        for (int l = 0; l < 32; ++l) {
            if (!(present >> l & 1u)) continue;
            if (first < 0) first = l;
            if ((g.mask[p][l] & ~present) != 0u || !(g.mask[p][l] >> l & 1u)) {
                char text[200];
                std::snprintf(text, sizeof text,
                              "warp %u of block (%u,%u,%u): lane %d's mask 0x%08x names lanes "
                              "that did not take part (present 0x%08x) at line %d",
                              warp_index, blockIdx.x, blockIdx.y, blockIdx.z, l, g.mask[p][l],
                              present, g.line[p][l]);
                current->fail(text);
            }
            if (g.line[p][l] != g.line[p][first]) {
                char text[200];
                std::snprintf(text, sizeof text,
                              "warp %u of block (%u,%u,%u): lanes %d and %d met at different "
                              "warp intrinsics (lines %d and %d)",
                              warp_index, blockIdx.x, blockIdx.y, blockIdx.z, first, l,
                              g.line[p][first], g.line[p][l]);
                current->fail(text);
            }
        }
    }
    g.arrived = 0;
    g.gen.fetch_add(1, std::memory_order_release);
#if !CUDA_ON_CPU_FIBERS
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&g.gen), FUTEX_WAKE_PRIVATE, INT32_MAX,
            nullptr, nullptr, 0);
#endif
}

// Arrive at g's barrier (a warp's when lane >= 0, carrying value) and wait for the others.
// Returns the buffer parity this generation's values are in.
inline int arrive(Group& g, int lane, uint64_t value, uint32_t mask, int line, const char* what) {
    jitter();
    std::unique_lock<std::mutex> lock(g.m);
    const uint32_t gen = g.gen.load(std::memory_order_relaxed);
    const int p = gen & 1;
    if (lane >= 0) {
        if (g.arrived == 0) g.arrived_set[p] = 0;
        g.arrived_set[p] |= 1u << lane;
        g.value[p][lane] = value;
        g.mask[p][lane] = mask;
        g.line[p][lane] = line;
    }
    if (++g.arrived == g.expected) {
        release_locked(g, lane >= 0);
        lock.unlock();
    } else {
        lock.unlock();
        wait_generation(g, gen, what);
    }
    jitter();
    return p;
}

// A thread returned from the kernel: it leaves its block's and its warp's barriers.
inline void leave(Group& g, bool is_warp) {
    std::lock_guard<std::mutex> lock(g.m);
    --g.expected;
    if (g.arrived > 0 && g.arrived == g.expected) release_locked(g, is_warp);
}

inline void syncthreads(int line) {
    (void)line;
    arrive(current->block, -1, 0, 0, line, "__syncthreads");
}

template <class T>
inline T shfl_down_sync(int line, unsigned mask, T v, unsigned delta) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle type");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    Group& g = current->warps[warp_index];
    const int p = arrive(g, lane_index, bits, mask, line, "__shfl_down_sync");
    const unsigned src = lane_index + delta;
    if (src < 32) {
        std::memcpy(&v, &g.value[p][src], sizeof(T));
    }
    return v;
}

inline unsigned ballot_sync(int line, unsigned mask, int predicate) {
    Group& g = current->warps[warp_index];
    const int p = arrive(g, lane_index, predicate != 0, mask, line, "__ballot_sync");
    unsigned result = 0;
    for (int l = 0; l < 32; ++l) {
        if ((g.arrived_set[p] >> l & 1u) && g.value[p][l]) result |= 1u << l;
    }
    return result & mask;
}

// The thread body: run every block in order, meeting the others after each one.
template <class Body>
void run_thread(Launch& L, unsigned tid, const Body& body) {
    threadIdx = {tid % blockDim.x, tid / blockDim.x % blockDim.y,
                 tid / (blockDim.x * blockDim.y)};
    warp_index = tid / 32;
    lane_index = tid % 32;
#if CUDA_ON_CPU_JITTER
    jitter_rng.seed(jitter_seed * 7919u + tid + 1u);
#endif
    const unsigned long long blocks =
        (unsigned long long)gridDim.x * gridDim.y * gridDim.z;
    for (unsigned long long k = 0; k < blocks; ++k) {
        const unsigned long long b = L.order.empty() ? k : L.order[k];
        blockIdx = {unsigned(b % gridDim.x), unsigned(b / gridDim.x % gridDim.y),
                    unsigned(b / ((unsigned long long)gridDim.x * gridDim.y))};
        jitter();
        body();
        leave(L.warps[warp_index], true);
        leave(L.block, false);
        // The end-of-block barrier: the last thread to arrive resets the groups.
        std::unique_lock<std::mutex> lock(L.end.m);
        const uint32_t gen = L.end.gen.load(std::memory_order_relaxed);
        if (++L.end.arrived == L.end.expected) {
            L.block.expected = L.nthreads;
            L.block.arrived = 0;
            for (Group& w : L.warps) {
                w.expected = __builtin_popcount(w.members);
                w.arrived = 0;
            }
            release_locked(L.end, false);
            lock.unlock();
        } else {
            lock.unlock();
            wait_generation(L.end, gen, "the end of the block");
        }
    }
}

#if CUDA_ON_CPU_FIBERS
template <class Body>
struct FiberStart {
    Launch* launch;
    const Body* body;
    Fiber* fibers;
};
inline void* fiber_start = nullptr;

template <class Body>
void fiber_entry(int tid) {
    auto* start = static_cast<FiberStart<Body>*>(fiber_start);
    run_thread(*start->launch, unsigned(tid), *start->body);
    start->fibers[tid].finished = true;  // returning resumes uc_link: the scheduler
}

// Round-robin (random order per sweep with jitter) over the runnable fibers until all return.
template <class Body>
void run_fibers(Launch& L, const Body& body) {
    constexpr size_t kStack = 256 * 1024;
    std::vector<Fiber> fibers(L.nthreads);
    FiberStart<Body> start{&L, &body, fibers.data()};
    fiber_start = &start;
    for (unsigned t = 0; t < L.nthreads; ++t) {
        Fiber& f = fibers[t];
        f.stack.reset(new char[kStack]);  // uninitialised: pages are touched only when used
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack.get();
        f.context.uc_stack.ss_size = kStack;
        f.context.uc_link = &scheduler_context;
        makecontext(&f.context, reinterpret_cast<void (*)()>(&fiber_entry<Body>), 1, int(t));
    }
    std::vector<unsigned> order(L.nthreads);
    std::iota(order.begin(), order.end(), 0u);
    std::minstd_rand shuffle(jitter_seed + 1u);
    for (;;) {
        bool left = false, progressed = false;
#if CUDA_ON_CPU_JITTER
        std::shuffle(order.begin(), order.end(), shuffle);
#endif
        for (unsigned t : order) {
            Fiber& f = fibers[t];
            if (f.finished) continue;
            left = true;
            if (f.waiting_on != nullptr && f.waiting_on->load() == f.waiting_gen) continue;
            f.waiting_on = nullptr;
            threadIdx = f.thread_idx;
            blockIdx = f.block_idx;
            warp_index = f.warp;
            lane_index = f.lane;
#if CUDA_ON_CPU_JITTER
            jitter_rng = f.rng;
#endif
            running = &f;
            swapcontext(&scheduler_context, &f.context);
            running = nullptr;
            f.thread_idx = threadIdx;
            f.block_idx = blockIdx;
            f.warp = warp_index;
            f.lane = lane_index;
#if CUDA_ON_CPU_JITTER
            f.rng = jitter_rng;
#endif
            progressed = true;
        }
        if (!left) break;
        if (!progressed) {
            L.fail("deadlock: every unfinished thread waits at a barrier nobody else can reach");
            break;  // the waiting fibers are abandoned; none holds a lock
        }
    }
    fiber_start = nullptr;
}
#endif

template <class Body>
int run(const unsigned* grid, const unsigned* block, const Body& body, char* error,
        size_t error_len) {
    const unsigned long long threads = (unsigned long long)block[0] * block[1] * block[2];
    std::string problem;
    if (threads == 0 || threads > 1024 || block[2] > 64) {
        problem = "invalid block size (1..1024 threads, z <= 64)";
    } else if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[0] > 2147483647u ||
               grid[1] > 65535 || grid[2] > 65535) {
        problem = "invalid grid size (x < 2^31, y and z <= 65535, none 0)";
    }
    if (!problem.empty()) {
        std::snprintf(error, error_len, "%s", problem.c_str());
        return 1;
    }
    std::lock_guard<std::mutex> serial(launch_mutex);
    Launch L;
    L.nthreads = unsigned(threads);
    L.block.expected = L.nthreads;
    L.end.expected = L.nthreads;
    L.warps = std::vector<Group>((L.nthreads + 31) / 32);
    for (unsigned w = 0; w < L.warps.size(); ++w) {
        const unsigned lanes = std::min(32u, L.nthreads - 32 * w);
        L.warps[w].members = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
        L.warps[w].expected = lanes;
    }
    blockDim = {block[0], block[1], block[2]};
    gridDim = {grid[0], grid[1], grid[2]};
#if CUDA_ON_CPU_JITTER
    {
        const unsigned long long blocks = (unsigned long long)grid[0] * grid[1] * grid[2];
        if (blocks <= (1ull << 24)) {
            L.order.resize(blocks);
            std::iota(L.order.begin(), L.order.end(), 0ull);
            std::minstd_rand rng(jitter_seed * 31u + 17u);
            std::shuffle(L.order.begin(), L.order.end(), rng);
        }
    }
#endif
    current = &L;
#if CUDA_ON_CPU_FIBERS
    run_fibers(L, body);
#else
    std::vector<std::thread> pool;
    pool.reserve(L.nthreads);
    for (unsigned t = 0; t < L.nthreads; ++t) {
        pool.emplace_back([&L, t, &body] { run_thread(L, t, body); });
    }
    for (std::thread& t : pool) t.join();
#endif
    current = nullptr;
    std::snprintf(error, error_len, "%s", L.error.c_str());
    return L.error.empty() ? 0 : 1;
}

// Argument kinds reported to the loader: 1 signed integer, 2 unsigned integer, 3 floating
// point, 4 bool; +10 for a pointer to that kind.
template <class T>
constexpr int kind_of() {
    if constexpr (std::is_pointer<T>::value) {
        return 10 + kind_of<std::remove_cv_t<std::remove_pointer_t<T>>>();
    } else if constexpr (std::is_same<T, bool>::value) {
        return 4;
    } else if constexpr (std::is_floating_point<T>::value) {
        return 3;
    } else if constexpr (std::is_integral<T>::value) {
        return std::is_signed<T>::value ? 1 : 2;
    } else {
        return 0;
    }
}

template <class T>
constexpr int size_of() {
    if constexpr (std::is_pointer<T>::value) {
        return int(sizeof(std::remove_pointer_t<T>));  // the element size of the array
    } else {
        return int(sizeof(T));
    }
}

template <class... A>
int signature(void (*)(A...), const int** sizes, const int** kinds) {
    static const int s[] = {size_of<A>()..., 0};
    static const int k[] = {kind_of<A>()..., 0};
    *sizes = s;
    *kinds = k;
    return int(sizeof...(A));
}

template <class... A, size_t... I>
void call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <class... A>
int launch(void (*kernel)(A...), const unsigned* grid, const unsigned* block, void** args,
           char* error, size_t error_len) {
    const auto body = [kernel, args] { call(kernel, args, std::index_sequence_for<A...>{}); };
    return run(grid, block, body, error, error_len);
}

}  // namespace cuda_on_cpu

#define __syncthreads() ::cuda_on_cpu::syncthreads(__LINE__)
#define __shfl_down_sync(mask, v, delta) ::cuda_on_cpu::shfl_down_sync(__LINE__, mask, v, delta)
#define __ballot_sync(mask, p) ::cuda_on_cpu::ballot_sync(__LINE__, mask, p)

static inline unsigned int __brev(unsigned int x) {
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
struct alignas(16) float4 {
    float x, y, z, w;
};
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline unsigned int atomicAdd(unsigned int* address, unsigned int value) {
    return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __double2float_rn(double d) { return static_cast<float>(d); }

extern "C" void cuda_on_cpu_seed(unsigned seed) { cuda_on_cpu::jitter_seed = seed; }

#define CUDA_ON_CPU_EXPORT(name)                                                            \
    extern "C" int cuda_on_cpu_launch_##name(const unsigned* grid, const unsigned* block,   \
                                             void** args, char* error, size_t error_len) {  \
        return ::cuda_on_cpu::launch(name, grid, block, args, error, error_len);            \
    }                                                                                       \
    extern "C" int cuda_on_cpu_signature_##name(const int** sizes, const int** kinds) {     \
        return ::cuda_on_cpu::signature(name, sizes, kinds);                                \
    }
