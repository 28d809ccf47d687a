// A host model of the CUDA execution subset the row-format kernels use, so
// that csrc/cuda/row_format_kernels.cuh runs unmodified on a machine without
// a GPU (csrc/tests/test_cuda_kernels.cpp, and the DSPARK_CUDA=EMULATE build
// with the emulated runtime in cuda_runtime.h).
//
// What is modelled:
//  * threadIdx / blockIdx / blockDim / gridDim (x only) and a launch of
//    `grid` blocks of `block` threads;
//  * warps of 32 lanes running in lock step: every lane is a fiber (started
//    with makecontext / setcontext, then switched with the compiler's
//    __builtin_setjmp / __builtin_longjmp: no signal mask, so no system call
//    per switch, and unlike the C library's longjmp not rejected by
//    _FORTIFY_SOURCE for jumping to another stack; under AddressSanitizer
//    swapcontext, which it understands better) that runs
//    until it reaches a warp collective (__ballot_sync,
//    __shfl_sync, __shfl_xor_sync, __shfl_down_sync) and waits there until
//    all 32 lanes have; the collective is then evaluated and every lane
//    resumes with its result;
//  * __ffs and atomicMin (warps run one after another, so plain reads and
//    writes are atomic);
//  * the vector types float4 / uint2 / uint4, whose accesses must be aligned
//    to their size (a misaligned one is a fault on a GPU, an error here).
//
// What is checked, because a GPU would give undefined results or hang: every
// collective must be reached by all 32 lanes with a full mask and the same
// operation (a lane that has exited, or waits at a different collective, is
// an error), and width must be 32. Errors are thrown from launch().
//
// Not modelled (and therefore not declared, so a kernel using them does not
// compile here): shared memory, __syncthreads, other atomics, y / z grids.
// Blocks and warps run one after another, which is a valid schedule for
// kernels without inter-warp communication.
#pragma once

#define DSPARK_CUDA_EMULATION 1

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)

using cudaStream_t = void*;

// CUDA's vector types (the kernels' 8- and 16-byte accesses).
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

struct dspark_emu_dim3 {
    unsigned x = 0, y = 0, z = 0;
};
inline dspark_emu_dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace dspark_emu {

constexpr int WARP = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr std::size_t LANE_STACK_BYTES = 256 * 1024;

enum class Op { None, Ballot, Shfl, ShflXor, ShflDown };

inline const char* op_name(Op op) {
    switch (op) {
        case Op::Ballot: return "__ballot_sync";
        case Op::Shfl: return "__shfl_sync";
        case Op::ShflXor: return "__shfl_xor_sync";
        case Op::ShflDown: return "__shfl_down_sync";
        default: return "none";
    }
}

// swapcontext under AddressSanitizer (it tracks those switches) and off
// x86-64 (clang has no __builtin_setjmp on e.g. aarch64).
#if defined(__SANITIZE_ADDRESS__) || !defined(__x86_64__)
#define DSPARK_EMU_SWAPCONTEXT 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DSPARK_EMU_SWAPCONTEXT 1
#endif
#endif

// A __builtin_setjmp buffer (five words: frame, resume address, stack, spare).
struct JumpBuf {
    void* words[5] = {};
};

#if !defined(DSPARK_EMU_SWAPCONTEXT)
// __builtin_longjmp must not be called from the function that calls
// __builtin_setjmp, hence this separate, never-inlined function. noipa: GCC's
// interprocedural register allocation (with LTO) would otherwise assume this
// call preserves registers that the fiber we come back from has clobbered.
#if defined(__clang__)
[[gnu::noinline]]
#else
[[gnu::noinline, gnu::noipa]]
#endif
inline void jump_to(JumpBuf& b) { __builtin_longjmp(b.words, 1); }
#endif

struct Lane {
    ucontext_t ctx{};  // the fiber's start (and, with swapcontext, its saved state)
    JumpBuf jb;        // where a waiting lane resumes
    char* stack = nullptr;  // LANE_STACK_BYTES, from lane_stacks()
    bool started = false;
    bool done = false;
    // The collective this lane waits at (Op::None while running or done).
    Op op = Op::None;
    unsigned mask = 0;
    std::uint32_t value = 0;
    int arg = 0;
    std::uint32_t result = 0;
};

struct Warp {
    ucontext_t scheduler{};
    JumpBuf scheduler_jb;
    Lane lanes[WARP];
    int current = 0;
    const std::function<void()>* body = nullptr;
    std::string error;
};

inline Warp*& active_warp() {
    static Warp* w = nullptr;
    return w;
}

// Kernel launches so far (tests check "one launch per contiguous run").
inline std::size_t& launch_count() {
    static std::size_t n = 0;
    return n;
}

// Whether this thread is inside launch() (a kernel launching a kernel).
inline bool& in_launch() {
    static thread_local bool inside = false;
    return inside;
}

// An error found while a kernel runs: recorded for the scheduler, which
// throws it from launch() once the lane yields (exceptions are not thrown
// across fiber stacks, which AddressSanitizer cannot follow); outside a
// launch, thrown at once.
inline void kernel_error(const std::string& what) {
    Warp* w = active_warp();
    if (w == nullptr || !in_launch()) throw std::runtime_error(what);
    if (w->error.empty()) w->error = what;
}

// Switch from lane `me` back to the scheduler; returns when resumed.
inline void yield_to_scheduler(Warp* w, Lane& me) {
#if defined(DSPARK_EMU_SWAPCONTEXT)
    swapcontext(&me.ctx, &w->scheduler);
#else
    if (__builtin_setjmp(me.jb.words) == 0) jump_to(w->scheduler_jb);
#endif
}

// A lane's fiber, started once per launch and reused for every warp: run
// the kernel body as the current thread, report done, wait to be resumed
// for the next warp.
inline void lane_main() {
    Warp* w = active_warp();
    for (;;) {
        const int l = w->current;
        try {
            (*w->body)();
        } catch (const std::exception& e) {
            w->error = std::string("kernel threw: ") + e.what();
        } catch (...) {
            w->error = "kernel threw a non-std exception";
        }
        w->lanes[l].done = true;
        yield_to_scheduler(w, w->lanes[l]);
    }
}

// Run lane l of w until it waits at a collective or is done.
inline void resume(Warp& w, int l) {
    Lane& x = w.lanes[l];
    w.current = l;
#if defined(DSPARK_EMU_SWAPCONTEXT)
    swapcontext(&w.scheduler, &x.ctx);
#else
    if (__builtin_setjmp(w.scheduler_jb.words) == 0) {
        if (!x.started) {
            x.started = true;
            setcontext(&x.ctx);
        }
        jump_to(x.jb);
    }
#endif
}

// Called on a lane's fiber: wait at a collective, return this lane's result.
inline std::uint32_t collective(Op op, unsigned mask, std::uint32_t value, int arg) {
    Warp* w = active_warp();
    if (w == nullptr) throw std::logic_error("warp collective outside an emulated launch");
    Lane& me = w->lanes[w->current];
    me.op = op;
    me.mask = mask;
    me.value = value;
    me.arg = arg;
    yield_to_scheduler(w, me);
    return me.result;
}

// Evaluates the collective all 32 lanes wait at.
inline void evaluate(Warp& w) {
    const Lane& l0 = w.lanes[0];
    for (int l = 0; l < WARP; ++l) {
        const Lane& x = w.lanes[l];
        if (x.op != l0.op || x.mask != FULL_MASK || l0.mask != FULL_MASK)
            throw std::runtime_error(std::string("warp divergence: lane 0 waits at ") + op_name(l0.op) +
                                     " but lane " + std::to_string(l) + " at " + op_name(x.op) +
                                     " (or a mask is not full)");
    }
    std::uint32_t ballot = 0;
    for (int l = 0; l < WARP; ++l)
        if (w.lanes[l].value != 0) ballot |= 1u << l;
    for (int l = 0; l < WARP; ++l) {
        Lane& x = w.lanes[l];
        switch (x.op) {
            case Op::Ballot: x.result = ballot; break;
            // Width 32: a source lane outside 0..31 gives the lane its own value.
            case Op::Shfl: x.result = w.lanes[x.arg & (WARP - 1)].value; break;
            case Op::ShflXor: {
                const unsigned src = static_cast<unsigned>(l) ^ static_cast<unsigned>(x.arg);
                x.result = src < static_cast<unsigned>(WARP) ? w.lanes[src].value : x.value;
                break;
            }
            case Op::ShflDown: {
                const unsigned src = static_cast<unsigned>(l) + static_cast<unsigned>(x.arg);
                x.result = static_cast<unsigned>(x.arg) < static_cast<unsigned>(WARP) && src < static_cast<unsigned>(WARP)
                               ? w.lanes[src].value
                               : x.value;
                break;
            }
            default: break;
        }
        x.op = Op::None;
    }
}

// The lanes' stacks, mapped once (only touched pages cost), each with an
// inaccessible guard page below it: a lane overflowing its stack faults
// instead of overwriting its neighbour's frames.
inline std::size_t guarded_stack_bytes() {
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    return LANE_STACK_BYTES + page;
}

inline char* lane_stacks() {
    static char* stacks = [] {
        const std::size_t page = guarded_stack_bytes() - LANE_STACK_BYTES;
        void* p = mmap(nullptr, WARP * guarded_stack_bytes(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                       -1, 0);
        if (p == MAP_FAILED) throw std::runtime_error("emulated launch: cannot map the lane stacks");
        for (int l = 0; l < WARP; ++l)
            mprotect(static_cast<char*>(p) + static_cast<std::size_t>(l) * guarded_stack_bytes(), page, PROT_NONE);
        return static_cast<char*>(p);
    }();
    return stacks;
}

// Starts the 32 lane fibers of a launch.
inline void start_lanes(Warp& w) {
    for (int l = 0; l < WARP; ++l) {
        Lane& x = w.lanes[l];
        x.stack = lane_stacks() + static_cast<std::size_t>(l) * guarded_stack_bytes() +
                  (guarded_stack_bytes() - LANE_STACK_BYTES);
        getcontext(&x.ctx);
        x.ctx.uc_stack.ss_sp = x.stack;
        x.ctx.uc_stack.ss_size = LANE_STACK_BYTES;
        x.ctx.uc_link = nullptr;  // lane_main never returns
        makecontext(&x.ctx, lane_main, 0);
        x.started = false;
    }
}

// Runs the warp `warp` of the current block to completion.
inline void run_warp(Warp& w, unsigned warp) {
    for (Lane& x : w.lanes) {
        x.done = false;
        x.op = Op::None;
    }
    for (;;) {
        int waiting = 0, done = 0;
        for (int l = 0; l < WARP; ++l) {
            if (w.lanes[l].done) continue;
            threadIdx.x = warp * WARP + static_cast<unsigned>(l);
            resume(w, l);
            if (!w.error.empty()) throw std::runtime_error(w.error);
        }
        for (int l = 0; l < WARP; ++l) {
            done += w.lanes[l].done ? 1 : 0;
            waiting += w.lanes[l].op != Op::None ? 1 : 0;
        }
        if (done == WARP) return;
        if (waiting != WARP)
            throw std::runtime_error("warp divergence: " + std::to_string(done) +
                                     " lanes exited while the others wait at a warp collective");
        evaluate(w);
    }
}

// kernel<<<grid, block>>>: `body` is the kernel call (reading threadIdx etc.).
inline void launch(unsigned grid, unsigned block, const std::function<void()>& body) {
    if (grid == 0 || block == 0 || block % WARP != 0 || block > 1024)
        throw std::invalid_argument("emulated launch: grid must be > 0 and block a multiple of 32 up to 1024");
    // One launch at a time (the emulated device has one queue; the lane
    // stacks, active_warp() and threadIdx & co. are process-wide). A launch
    // from inside a kernel (dynamic parallelism) is not modelled.
    if (in_launch()) {
        kernel_error("emulated launch from inside a kernel is not supported");
        return;
    }
    static std::mutex device;
    std::lock_guard<std::mutex> lock(device);
    in_launch() = true;
    ++launch_count();
    struct Leave {
        ~Leave() { in_launch() = false; }
    } leave;
    Warp w;
    w.body = &body;
    active_warp() = &w;
    start_lanes(w);
    gridDim.x = grid;
    blockDim.x = block;
    try {
        for (unsigned b = 0; b < grid; ++b) {
            blockIdx.x = b;
            for (unsigned wi = 0; wi < block / WARP; ++wi) run_warp(w, wi);
        }
    } catch (...) {
        active_warp() = nullptr;
        throw;
    }
    active_warp() = nullptr;
}

// Stream capture (CUDA graphs), as far as the kernels' callers need it:
// while a stream is captured, the kernel launches, device-to-device copies
// and memsets enqueued on it are recorded instead of run, and a graph
// launch replays them in order. A call that cannot be part of a graph, or
// that this model does not record (a synchronization, an allocation or
// free, a copy from or to host memory), fails and invalidates the capture,
// as CUDA's thread-local capture mode does for the unsafe ones. Stricter
// than a GPU in two respects, so that "no allocation and no host transfer in
// a captured call" is checked here: stream-ordered allocations (graph memory
// nodes) and copies from or to pinned host memory are refused too.
struct Capture {
    void* stream = nullptr;  // the stream being captured
    bool active = false;
    std::vector<std::function<void()>> ops;
    std::string error;  // the first call that invalidated the capture
};

inline Capture& capture() {
    static Capture c;
    return c;
}

// Whether an operation enqueued on `stream` is recorded instead of run.
inline bool capturing(void* stream) { return capture().active && capture().stream == stream; }

// A call that cannot be captured, made while a capture is active: the
// capture is invalidated (cudaStreamEndCapture then fails).
inline bool refuse_in_capture(const char* what) {
    if (!capture().active) return false;
    if (capture().error.empty()) capture().error = std::string(what) + " during stream capture";
    return true;
}

// launch(), or its record while `stream` is being captured.
inline void launch_on(void* stream, unsigned grid, unsigned block, std::function<void()> body) {
    if (capturing(stream)) {
        capture().ops.emplace_back([grid, block, body] { launch(grid, block, body); });
        return;
    }
    launch(grid, block, body);
}

template <class T>
std::uint32_t to_bits(T v) {
    static_assert(sizeof(T) == 4 && std::is_trivially_copyable<T>::value, "4-byte shuffles only");
    std::uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
}

template <class T>
T from_bits(std::uint32_t u) {
    T v;
    std::memcpy(&v, &u, 4);
    return v;
}

inline void require_width(int width) {
    if (width != WARP) throw std::runtime_error("emulated shuffles support width 32 only");
}

}  // namespace dspark_emu

inline unsigned __ballot_sync(unsigned mask, int predicate) {
    return dspark_emu::collective(dspark_emu::Op::Ballot, mask, predicate != 0 ? 1u : 0u, 0);
}

template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
    dspark_emu::require_width(width);
    return dspark_emu::from_bits<T>(
        dspark_emu::collective(dspark_emu::Op::Shfl, mask, dspark_emu::to_bits(var), src_lane));
}

template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
    dspark_emu::require_width(width);
    return dspark_emu::from_bits<T>(
        dspark_emu::collective(dspark_emu::Op::ShflXor, mask, dspark_emu::to_bits(var), lane_mask));
}

template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
    dspark_emu::require_width(width);
    return dspark_emu::from_bits<T>(
        dspark_emu::collective(dspark_emu::Op::ShflDown, mask, dspark_emu::to_bits(var), static_cast<int>(delta)));
}

namespace dspark_emu {
// A GPU faults on a vector access that is not aligned to its size; so does
// the emulation (the kernel's launch throws).
// Returns whether the access may go ahead.
inline bool check_vector_access(const void* p, std::size_t align) {
    if (reinterpret_cast<std::uintptr_t>(p) % align == 0) return true;
    kernel_error("misaligned " + std::to_string(align) + "-byte vector access");
    return false;
}
}  // namespace dspark_emu

inline int __ffs(unsigned x) { return x == 0 ? 0 : __builtin_ctz(x) + 1; }

inline unsigned long long atomicMin(unsigned long long* address, unsigned long long val) {
    const unsigned long long old = *address;
    if (val < old) *address = val;
    return old;
}
