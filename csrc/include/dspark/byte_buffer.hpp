// ByteVec: the byte vector behind the feature ring and the staged-row buffers.
//
// Two properties matter on the hot path:
//  * no zero-fill: every byte is written by a copy or a conversion before it is
//    read, so value-initialising it first would double the write traffic;
//  * large buffers (a window of 100 KiB rows is hundreds of MiB; a rebase
//    stages W/2 rows) are 2 MiB-aligned and advised as transparent huge pages
//    on Linux, so first touch costs one fault per 2 MiB instead of per 4 KiB
//    (51,201 faults for one 200 MB f32 rebase with plain malloc).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace dspark {

// Buffers at least this large get the huge-page treatment.
inline constexpr std::size_t HUGE_ALLOC_BYTES = std::size_t(4) << 20;
inline constexpr std::size_t HUGE_PAGE_BYTES = std::size_t(2) << 20;

// Advise the 2 MiB-aligned interior of [p, p + n) as transparent huge pages
// before its first touch: for large buffers allocated elsewhere (a Python
// bytes object a snapshot is written into), so that first touch costs one
// fault per 2 MiB. Advice only: it changes no byte and failure is harmless.
inline void advise_huge_pages(void* p, std::size_t n) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (n < HUGE_ALLOC_BYTES) return;
    const auto lo = (reinterpret_cast<std::uintptr_t>(p) + HUGE_PAGE_BYTES - 1) / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
    const auto hi = (reinterpret_cast<std::uintptr_t>(p) + n) / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
    if (hi > lo) (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
    (void)p;
    (void)n;
#endif
}

template <class T>
struct UninitAllocator {
    using value_type = T;
    template <class U>
    struct rebind { using other = UninitAllocator<U>; };

    UninitAllocator() noexcept = default;
    template <class U>
    UninitAllocator(const UninitAllocator<U>&) noexcept {}

    T* allocate(std::size_t n) {
        const std::size_t bytes = n * sizeof(T);
        if (bytes < HUGE_ALLOC_BYTES) return std::allocator<T>().allocate(n);
        const std::size_t rounded = (bytes + HUGE_PAGE_BYTES - 1) / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
        void* p = nullptr;
        if (posix_memalign(&p, HUGE_PAGE_BYTES, rounded) != 0 || p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
        (void)madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
        return static_cast<T*>(p);
    }
    void deallocate(T* p, std::size_t n) noexcept {
        if (n * sizeof(T) < HUGE_ALLOC_BYTES) std::allocator<T>().deallocate(p, n);
        else std::free(p);
    }
    // Default-initialise (i.e. leave uninitialised) instead of zero-filling.
    template <class U>
    void construct(U* p) noexcept { ::new (static_cast<void*>(p)) U; }
    template <class U, class... A>
    void construct(U* p, A&&... a) { ::new (static_cast<void*>(p)) U(std::forward<A>(a)...); }

    template <class U>
    bool operator==(const UninitAllocator<U>&) const noexcept { return true; }
    template <class U>
    bool operator!=(const UninitAllocator<U>&) const noexcept { return false; }
};

using ByteVec = std::vector<std::uint8_t, UninitAllocator<std::uint8_t>>;

// Staging buffers kept for reuse. A fresh buffer costs the kernel a zero-fill
// of every page on first touch, and its mmap / munmap take the process's
// address-space lock, which serialises threads: a steady round at D = 25,600
// stages 9 rows (900 KB) and spent more time faulting in a fresh buffer than
// copying into it, and two threads drafting at once ran no faster than one.
// A rebase stages W/2 rows (200 MB for a 27B target's f32 rows). The binding
// hands a plan's buffer back here when the plan is freed.
// Thread-safe. Holds at most MAX_LARGE buffers of MIN_LARGE_BYTES or more and
// MAX_SMALL smaller ones of MIN_BYTES or more (at most MAX_SMALL * 4 MiB).
class BufferPool {
public:
    static constexpr std::size_t MIN_BYTES = std::size_t(64) << 10;
    static constexpr std::size_t MIN_LARGE_BYTES = HUGE_ALLOC_BYTES;
    static constexpr std::size_t MAX_LARGE = 2;
    static constexpr std::size_t MAX_SMALL = 8;

    // Make `v` able to hold `bytes` bytes, keeping its first v.size() bytes,
    // reusing the smallest pooled buffer that is large enough.
    void grow(ByteVec& v, std::size_t bytes) {
        if (bytes <= v.capacity()) return;
        ByteVec reuse;
        if (bytes >= MIN_BYTES) {
            std::lock_guard<std::mutex> lock(mu_);
            std::size_t best = free_.size();
            for (std::size_t i = 0; i < free_.size(); ++i)
                if (free_[i].capacity() >= bytes && (best == free_.size() || free_[i].capacity() < free_[best].capacity()))
                    best = i;
            if (best != free_.size()) {
                reuse = std::move(free_[best]);
                free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
            }
        }
        if (reuse.capacity() < bytes) reuse.reserve(bytes);
        reuse.assign(v.begin(), v.end());
        give(std::move(v));
        v = std::move(reuse);
    }

    // Take back a buffer nobody uses any more.
    void give(ByteVec v) noexcept {
        const std::size_t cap = v.capacity();
        if (cap < MIN_BYTES) return;
        const bool large = cap >= MIN_LARGE_BYTES;
        ByteVec dropped;  // freed after the lock is released
        {
            std::lock_guard<std::mutex> lock(mu_);
            v.clear();
            std::size_t same = 0;  // pooled buffers of its class, and the smallest of them
            auto smallest = free_.end();
            for (auto it = free_.begin(); it != free_.end(); ++it)
                if ((it->capacity() >= MIN_LARGE_BYTES) == large) {
                    ++same;
                    if (smallest == free_.end() || it->capacity() < smallest->capacity()) smallest = it;
                }
            if (same < (large ? MAX_LARGE : MAX_SMALL)) {
                try {
                    free_.push_back(std::move(v));
                } catch (...) {  // no room for the record: the buffer is simply freed
                }
            } else if (smallest->capacity() < cap) {  // keep the largest ones
                dropped = std::move(*smallest);
                *smallest = std::move(v);
            }
        }
    }

    std::size_t pooled_bytes() const {
        std::lock_guard<std::mutex> lock(mu_);
        std::size_t n = 0;
        for (const auto& b : free_) n += b.capacity();
        return n;
    }

private:
    mutable std::mutex mu_;
    std::vector<ByteVec> free_;
};

}  // namespace dspark
