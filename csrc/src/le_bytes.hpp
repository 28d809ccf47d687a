// Little-endian field access for the core's byte formats (snapshots, exported
// prefix blocks): the same bytes on every host. Private: not installed.
#pragma once
#include <cstddef>
#include <cstdint>

namespace dspark {
namespace le {

template <class T>
void put(std::uint8_t* at, T v) {
    for (std::size_t i = 0; i < sizeof(T); ++i) at[i] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(v) >> (8 * i));
}

template <class T>
T take(const std::uint8_t* at) {
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) v |= static_cast<std::uint64_t>(at[i]) << (8 * i);
    return static_cast<T>(v);
}

}  // namespace le
}  // namespace dspark
