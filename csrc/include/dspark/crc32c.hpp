// CRC-32C (Castagnoli; iSCSI, ext4, SSE4.2's crc32 instruction): the checksum
// of snapshot format v2. Parameters: reflected polynomial 0x82F63B78, initial
// value and final xor 0xFFFFFFFF, so crc32c(0, "123456789", 9) == 0xE3069283.
//
// Paths with identical results, chosen at run time (the wheel runs on any
// x86-64 or aarch64): the SSE4.2 crc32 instruction or the ARMv8 CRC32C
// instructions, in three interleaved streams (near memory bandwidth), and a
// portable slicing-by-8 table loop. Thread-safe, no allocation.
#pragma once
#include <cstddef>
#include <cstdint>

#include "dspark/dispatch.hpp"

namespace dspark {

// The path numbers of the dispatch registry's Crc32c family.
enum class CrcPath : std::uint8_t { Portable = 0, Sse42 = 1, ArmCrc = 2 };

// Running CRC: crc32c(crc32c(0, a, na), b, nb) == crc32c(0, a ++ b, na + nb).
std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t n) noexcept;

// Copies n bytes src -> dst (must not overlap) and returns crc32c(crc, src, n),
// reading src from memory once (SSE4.2: each word is checksummed and stored
// in the same loop; portable: each L1-sized chunk is checksummed, then copied
// from cache). Large copies use non-temporal stores where the path has them.
std::uint32_t crc32c_copy(std::uint32_t crc, void* dst, const void* src, std::size_t n) noexcept;
// crc32c_copy for a source another thread may write during the call (a
// caller's buffer handed to restore): the checksum returned is always that of
// the bytes stored in dst, so a source changing under the call never passes as
// intact. crc32c_copy may read a chunk twice where its stores would alias its
// loads (SSE4.2 on AMD cores); this one stages such a chunk in L1 instead
// (about a third slower there, the same elsewhere).
std::uint32_t crc32c_copy_shared(std::uint32_t crc, void* dst, const void* src, std::size_t n) noexcept;

// Runtime dispatch: the Crc32c family of the dispatch registry
// (dspark/dispatch.hpp), typed. The active path starts as the best one this
// CPU supports; DSPARK_SIMD=portable (or =scalar, which also makes the row
// formats scalar) starts it on the portable loop. set_crc_path throws
// std::invalid_argument for an unsupported path.
bool crc_path_supported(CrcPath p) noexcept;
CrcPath best_crc_path() noexcept;
CrcPath active_crc_path() noexcept;
void set_crc_path(CrcPath p);
const char* crc_path_name(CrcPath p) noexcept;

}  // namespace dspark
