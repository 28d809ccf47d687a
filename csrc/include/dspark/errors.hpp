// Error types of the dspark core. The core never aborts on bad input: every
// rejected call throws one of these (or std::invalid_argument for a bad
// argument value) before it changes any state, and the Python binding maps
// each to its Python exception.
#pragma once
#include <stdexcept>
#include <string>

namespace dspark {

// A configuration that can never work (window <= 2 * block, bad storage, ...).
// Python: dspark_core.ConfigError (a ValueError).
struct ConfigError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

// A call made in the wrong protocol state (e.g. process() while a round is
// open). Python: dspark_core.StateError (a RuntimeError).
struct StateError : std::logic_error {
    using std::logic_error::logic_error;
};

// An argument of the wrong kind (not its value): unsupported dtype or format.
// Python: TypeError.
struct TypeError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

// Bad argument values (shape, position, range, non-finite data) use
// std::invalid_argument. Python: ValueError.

}  // namespace dspark
