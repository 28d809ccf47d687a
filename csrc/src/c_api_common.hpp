// What the C ABI's translation units share (private: not installed): this
// thread's last error and last moves, the guard that maps every exception to
// its status (the core's one table, DSPARK_ERROR_KINDS), converted() (a
// failed conversion lets the core's sequence checks speak first), the
// conversions of C arguments, and the stager handle. c_api.cpp holds the
// Stager and row format calls, c_api_prefix.cpp the prefix store's.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "dspark/dspark.h"
#include "dspark/errors.hpp"
#include "dspark/row_format.hpp"
#include "dspark/stager.hpp"

// The handle: the Stager plus what the C layer needs to answer about it.
struct dspark_stager {
    dspark::Stager core;
    dspark_config config;
    explicit dspark_stager(const dspark::StagerOptions& o, const dspark_config& c) : core(o), config(c) {}
};

namespace dspark_c {

inline thread_local std::string last_error;
// This thread's last dspark_fork / dspark_shift moves, as the core returned
// them (swapped in: recording them allocates nothing after the op changed the
// Stager), and their C copy, made when dspark_last_moves asks (exactly their
// size). And the runs of its last dspark_restore. Each is reset before its
// call runs, so a failed call leaves none behind.
inline thread_local std::vector<dspark::SlotMove> last_moves;
inline thread_local std::vector<dspark_slot_move> last_moves_c;
inline thread_local bool last_moves_copied = true;  // last_moves_c holds last_moves
inline thread_local dspark::SlotRun last_restore_runs[2];

inline dspark_status status_of(dspark::ErrorKind kind) noexcept {
    switch (kind) {
#define DSPARK_STATUS_CASE(k, c_status, python) \
    case dspark::ErrorKind::k: return DSPARK_E_##c_status;
        DSPARK_ERROR_KINDS(DSPARK_STATUS_CASE)
#undef DSPARK_STATUS_CASE
    }
    return DSPARK_E_INTERNAL;
}

inline dspark_status fail_with(dspark_status code, const char* what) noexcept {
    try {
        last_error = what;
    } catch (...) {
        last_error.clear();  // no memory for the message: the code still says it
    }
    return code;
}

// Runs body() and maps what it throws. `needed` (optional) receives
// BufferTooSmall::needed.
template <class Body>
dspark_status guarded(Body&& body, std::size_t* needed = nullptr) noexcept {
    last_error.clear();
    try {
        body();
        return DSPARK_OK;
    } catch (...) {
        const dspark::CaughtError e = dspark::classify_current_error();
        if (needed && e.kind == dspark::ErrorKind::BufferTooSmall) *needed = e.needed;
        return fail_with(status_of(e.kind), e.what);
    }
}

// Converts a call's C arguments; when that fails, the core's own sequence
// checks (an unknown sequence, the round state: design.md 2.1) come first,
// then the conversion's error. The one place this layer orders errors.
template <class Convert>
auto converted(const dspark::Stager& core, std::int64_t seq, dspark::Stager::Need need, Convert&& convert) {
    try {
        return convert();
    } catch (...) {
        core.check_sequence(seq, need);
        throw;
    }
}
template <class Convert>
auto converted(const dspark::Stager& core, std::int64_t seq, bool open_round, Convert&& convert) {
    return converted(core, seq, open_round ? dspark::Stager::Need::Open : dspark::Stager::Need::Ready,
                     static_cast<Convert&&>(convert));
}

// The same for a batch call named `call` (the core's name, "process_many"):
// its sequences' ids and states come first.
template <class Convert>
auto converted_batch(const dspark::Stager& core, const char* call, const std::int64_t* seqs, std::size_t n,
                     dspark::Stager::Need need, Convert&& convert) {
    try {
        return convert();
    } catch (...) {
        core.check_batch(call, seqs, n, need);
        throw;
    }
}

inline void require(const void* p, const char* name) {
    if (!p) throw dspark::NullPointer(std::string(name) + " is NULL");
}

// A typed buffer is aligned for its type: the core reads and writes it as
// T (a misaligned one is undefined behaviour, and a fault on some CPUs).
template <class T>
void require_aligned(const T* p, const char* name) {
    if constexpr (!std::is_void_v<T>) {
        if (reinterpret_cast<std::uintptr_t>(p) % alignof(T) != 0)
            throw std::invalid_argument(std::string(name) + " is not aligned to " + std::to_string(alignof(T)) +
                                        " bytes (the alignment of its element type)");
    }
}

// Whether a T buffer's length counts bytes (void and byte buffers).
template <class T>
constexpr bool counts_bytes() {
    if constexpr (std::is_void_v<T>) return true;
    else return sizeof(T) == 1;
}

// A buffer of `n` elements (bytes for void and byte buffers) may be NULL
// only when it is empty, and is aligned for its element type.
template <class T>
void require_buffer(const T* p, std::size_t n, const char* name) {
    constexpr bool bytes = counts_bytes<T>();
    if (!p && n)
        throw dspark::NullPointer(std::string(name) + " is NULL but " + std::to_string(n) +
                                  (bytes ? " bytes were given" : " entries were given"));
    require_aligned(p, name);
}

// int32 codes -> the core's enums, with the core's message naming the valid codes.
inline dspark::Storage storage_of(std::int32_t code) {
    return dspark::enum_from_code<dspark::TypeError>("storage", code, dspark::STORAGE_COUNT, dspark::storage_name);
}
inline dspark::ElemType elem_of(std::int32_t code) {
    return dspark::enum_from_code<dspark::TypeError>("dtype", code, dspark::ELEM_TYPE_COUNT, dspark::elem_name);
}
inline dspark::NonFinite nonfinite_of(std::int32_t code) {
    static_assert(DSPARK_NONFINITE_CLAMP + 1 == dspark::NONFINITE_COUNT, "the C codes follow dspark::NonFinite");
    return dspark::enum_from_code<std::invalid_argument>("nonfinite", code, dspark::NONFINITE_COUNT,
                                                         dspark::nonfinite_name);
}

// a * b, or invalid_argument naming `what` when it does not fit a size_t.
inline std::size_t mul_size(std::size_t a, std::size_t b, const char* what) {
    if (a != 0 && b > SIZE_MAX / a) throw std::invalid_argument(std::string(what) + " overflows size_t");
    return a * b;
}

// Output structs with a struct_size: the library writes the first
// min(struct_size, sizeof) bytes, keeping the caller's struct_size.
template <class T>
void write_sized(T* out, const T& value) {
    std::uint32_t size;
    std::memcpy(&size, out, sizeof size);
    if (size < sizeof(std::uint32_t)) throw std::invalid_argument("struct_size " + std::to_string(size) + " is too small");
    T v = value;
    v.struct_size = size;
    std::memcpy(static_cast<void*>(out), &v, std::min<std::size_t>(size, sizeof(T)));
}

// A record get (dspark_state_get, ...): the NULL check of out (after the
// caller's handle check), then `from()`, the core's record, copied field by
// field by `copy(from, to)` into zeroed bytes and written as write_sized does.
template <class C, class From, class Copy>
void get_record(C* out, From&& from, Copy&& copy) {
    require(out, "out");
    C to;
    std::memset(&to, 0, sizeof to);
    copy(from(), to);
    write_sized(out, to);
}

inline dspark::Stager& core_of(dspark_stager* st) {
    require(st, "stager");
    return st->core;
}
inline const dspark::Stager& core_of(const dspark_stager* st) {
    require(st, "stager");
    return st->core;
}

}  // namespace dspark_c
