// The one mapping from a thrown exception to its ErrorKind (errors.hpp).
#include "dspark/errors.hpp"

#include <new>
#include <string>

namespace dspark {

CaughtError classify_current_error() noexcept {
    // Order matters: the core's types derive from the std ones.
    try {
        throw;
    } catch (const BufferTooSmall& e) {
        return {ErrorKind::BufferTooSmall, e.what(), e.needed};
    } catch (const NullPointer& e) {
        return {ErrorKind::NullPointer, e.what(), 0};
    } catch (const Unsupported& e) {
        return {ErrorKind::Unsupported, e.what(), 0};
    } catch (const ConfigError& e) {
        return {ErrorKind::Config, e.what(), 0};
    } catch (const TypeError& e) {
        return {ErrorKind::Type, e.what(), 0};
    } catch (const StateError& e) {
        return {ErrorKind::State, e.what(), 0};
    } catch (const std::invalid_argument& e) {
        return {ErrorKind::InvalidArgument, e.what(), 0};
    } catch (const std::out_of_range& e) {
        return {ErrorKind::InvalidArgument, e.what(), 0};
    } catch (const std::bad_alloc&) {
        return {ErrorKind::OutOfMemory, "dspark_core: out of memory", 0};
    } catch (const std::exception& e) {
        return {ErrorKind::Internal, e.what(), 0};
    } catch (...) {
        return {ErrorKind::Internal, "dspark_core: unknown C++ exception", 0};
    }
}

void rethrow_with_prefix(const std::string& prefix) {
    // The same order as classify_current_error: derived types first.
    try {
        throw;
    } catch (const BufferTooSmall& e) {
        throw BufferTooSmall(prefix + e.what(), e.needed);
    } catch (const NullPointer& e) {
        throw NullPointer(prefix + e.what());
    } catch (const Unsupported& e) {
        throw Unsupported(prefix + e.what());
    } catch (const ConfigError& e) {
        throw ConfigError(prefix + e.what());
    } catch (const TypeError& e) {
        throw TypeError(prefix + e.what());
    } catch (const StateError& e) {
        throw StateError(prefix + e.what());
    } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(prefix + e.what());
    } catch (const std::out_of_range& e) {
        throw std::invalid_argument(prefix + e.what());
    }
    // anything else propagates as it is
}

}  // namespace dspark
