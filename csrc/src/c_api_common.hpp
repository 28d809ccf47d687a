// What the C ABI's translation units share (private: not installed): the
// exception-to-status mapping, this thread's last error and last moves, the
// argument checks, and the stager handle. c_api.cpp holds the Stager and row
// format calls, c_api_prefix.cpp the prefix store's.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "dspark/dspark.h"
#include "dspark/errors.hpp"
#include "dspark/stager.hpp"

// The handle: the Stager plus what the C layer needs to answer about it.
struct dspark_stager {
    dspark::Stager core;
    dspark_config config;
    explicit dspark_stager(const dspark::StagerOptions& o, const dspark_config& c) : core(o), config(c) {}
};

namespace dspark_c {

// This thread's last error message (dspark_last_error).
inline std::string& last_error() {
    thread_local std::string message;
    return message;
}

// The slot copies of this thread's last call that moves rows (dspark_fork,
// dspark_shift, dspark_prefix_publish, dspark_prefix_hit; dspark_last_moves):
// the ops stay atomic and need no caller buffer sized in advance. Reset
// before each such call runs, so a failed call leaves none behind.
inline std::vector<dspark_slot_move>& last_moves() {
    thread_local std::vector<dspark_slot_move> moves;
    return moves;
}

// Errors raised by the C layer itself (the core's own types carry the rest).
struct NullPointer : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};
struct Unsupported : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};
// An output buffer is too small; `needed` goes back to the caller.
struct TooSmall : std::length_error {
    std::size_t needed;
    TooSmall(const std::string& what, std::size_t n) : std::length_error(what), needed(n) {}
};

inline dspark_status fail_with(dspark_status code, const char* what) noexcept {
    try {
        last_error() = what;
    } catch (...) {
        last_error().clear();  // no memory for the message: the code still says it
    }
    return code;
}

// Runs body() and maps what it throws. `needed` (optional) receives
// TooSmall::needed. Order matters: the core's types derive from the std ones.
template <class Body>
dspark_status guarded(Body&& body, std::size_t* needed = nullptr) noexcept {
    last_error().clear();
    try {
        body();
        return DSPARK_OK;
    } catch (const TooSmall& e) {
        if (needed) *needed = e.needed;
        return fail_with(DSPARK_E_BUFFER_TOO_SMALL, e.what());
    } catch (const NullPointer& e) {
        return fail_with(DSPARK_E_NULL_POINTER, e.what());
    } catch (const Unsupported& e) {
        return fail_with(DSPARK_E_UNSUPPORTED, e.what());
    } catch (const dspark::ConfigError& e) {
        return fail_with(DSPARK_E_CONFIG, e.what());
    } catch (const dspark::TypeError& e) {
        return fail_with(DSPARK_E_TYPE, e.what());
    } catch (const dspark::StateError& e) {
        return fail_with(DSPARK_E_STATE, e.what());
    } catch (const std::invalid_argument& e) {
        return fail_with(DSPARK_E_INVALID_ARGUMENT, e.what());
    } catch (const std::out_of_range& e) {
        return fail_with(DSPARK_E_INVALID_ARGUMENT, e.what());
    } catch (const std::bad_alloc&) {
        return fail_with(DSPARK_E_OUT_OF_MEMORY, "dspark_core: out of memory");
    } catch (const std::exception& e) {
        return fail_with(DSPARK_E_INTERNAL, e.what());
    } catch (...) {
        return fail_with(DSPARK_E_INTERNAL, "dspark_core: unknown C++ exception");
    }
}

inline void require(const void* p, const char* name) {
    if (!p) throw NullPointer(std::string(name) + " is NULL");
}

// A buffer of `n` bytes may be NULL only when it is empty.
inline void require_buffer(const void* p, std::size_t n, const char* name) {
    if (!p && n) throw NullPointer(std::string(name) + " is NULL but " + std::to_string(n) + " bytes were given");
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

inline dspark::Stager& core_of(dspark_stager* st) {
    require(st, "stager");
    return st->core;
}
inline const dspark::Stager& core_of(const dspark_stager* st) {
    require(st, "stager");
    return st->core;
}

}  // namespace dspark_c
