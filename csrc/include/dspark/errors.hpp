// Error types of the dspark core. The core never aborts on bad input: every
// rejected call throws one of these (or std::invalid_argument for a bad
// argument value) before it changes any state.
//
// What each error becomes on every surface is written once, in
// DSPARK_ERROR_KINDS: the C ABI's status code (dspark.h, DSPARK_E_<code>)
// and the Python exception (the binding's _errors.hpp). classify_current_error()
// is the one place that decides which kind a thrown exception is; both
// translators call it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace dspark {

// A configuration that can never work (window <= 2 * block, bad storage, ...).
struct ConfigError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

// A call made in the wrong protocol state (e.g. process() while a round is
// open, or a strict Stager's draft whose n_past disagrees with its rows).
struct StateError : std::logic_error {
    using std::logic_error::logic_error;
};

// An argument of the wrong kind (not its value): unsupported dtype or format.
struct TypeError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

// A required pointer is null (C callers; a buffer of n > 0 bytes at NULL).
struct NullPointer : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

// A valid request this build or version does not support (e.g. config fields
// a newer caller sets).
struct Unsupported : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

// An output buffer is too small; `needed` is the size that would do.
struct BufferTooSmall : std::invalid_argument {
    std::size_t needed;
    BufferTooSmall(const std::string& what, std::size_t n) : std::invalid_argument(what), needed(n) {}
};

// Bad argument values (shape, position, range, non-finite data) use
// std::invalid_argument (std::out_of_range too).

// X(kind, C status suffix, Python exception): one row per kind, the order of
// classify_current_error's checks aside. The C status is DSPARK_E_<suffix>
// (c_api.cpp fails to compile if dspark.h lacks one); the Python exception is
// a builtin's name or ConfigError / StateError (_errors.hpp).
#define DSPARK_ERROR_KINDS(X)                                       \
    X(InvalidArgument, INVALID_ARGUMENT, ValueError)                \
    X(Config, CONFIG, ConfigError)                                  \
    X(State, STATE, StateError)                                     \
    X(Type, TYPE, TypeError)                                        \
    X(NullPointer, NULL_POINTER, ValueError)                        \
    X(BufferTooSmall, BUFFER_TOO_SMALL, ValueError)                 \
    X(OutOfMemory, OUT_OF_MEMORY, MemoryError)                      \
    X(Unsupported, UNSUPPORTED, ValueError)                         \
    X(Internal, INTERNAL, RuntimeError)

enum class ErrorKind : std::uint8_t {
#define DSPARK_ERROR_KIND_ENUM(kind, c_status, python) kind,
    DSPARK_ERROR_KINDS(DSPARK_ERROR_KIND_ENUM)
#undef DSPARK_ERROR_KIND_ENUM
};

// The enum value of an integer code a caller passed (a C ABI field, a C++
// caller's cast), or Error("<field> code N is not one of a (0), b (1), ...")
// when it names none. `name` is the enum's name table (nullptr-free below
// `count`).
template <class Error, class E>
E enum_from_code(const char* field, std::int64_t code, int count, const char* (*name)(E) noexcept) {
    if (code >= 0 && code < count) return static_cast<E>(code);
    std::string valid;
    for (int i = 0; i < count; ++i)
        valid += (i ? ", " : "") + std::string(name(static_cast<E>(i))) + " (" + std::to_string(i) + ")";
    throw Error(std::string(field) + " code " + std::to_string(code) + " is not one of " + valid);
}

// Call only inside a catch block: throws the error being handled again, as
// the same kind of error with `prefix` before its message (a batch call
// names the sequence an error is about). Errors of no kind a caller can
// cause (out of memory, internal) are rethrown unchanged.
[[noreturn]] void rethrow_with_prefix(const std::string& prefix);

// The exception being handled, classified: its kind, its message (valid
// while the handler that called classify_current_error runs) and, for
// BufferTooSmall, the size needed (else 0).
struct CaughtError {
    ErrorKind kind;
    const char* what;
    std::size_t needed;
};

// Call only inside a catch block: rethrows the current exception and maps it
// to its kind. Derived types are tested before their bases (ConfigError
// before std::invalid_argument, ...); an unknown exception is Internal.
CaughtError classify_current_error() noexcept;

}  // namespace dspark
