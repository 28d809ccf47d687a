// Runtime dispatch: the one registry of every kernel family the core chooses
// at run time (the row-format conversions, CRC-32C, and whatever family is
// added next), one CPU feature probe, one environment variable and one setter.
//
// A family has paths, each a complete set of its kernels compiled for one
// instruction set; path 0 is the portable one and always supported. Every
// path of a family gives identical bytes, so choosing one changes only speed.
// The paths of every architecture are listed on every build (a path this CPU
// or build lacks is "unsupported", not unknown), in preference order within
// an architecture: the best path is the last supported one.
//
// The environment variable DSPARK_SIMD forces paths when a family is first
// used: a comma-separated list of path names (case-insensitive), each naming
// one family's path, e.g. "avx2" or "neon,portable". "scalar" names the
// portable path of every family. A family no name picks starts on its best
// path; a name that is unknown or unsupported here is ignored (the core does
// not log: kernel_env_status() tells the caller, which warns). The older
// DSPARK_CRC32C=<crc32c path> is still read, after DSPARK_SIMD, for the
// CRC-32C family only (deprecated; kernel_env_deprecated() reports it).
//
// Thread-safe: a path switch is one atomic store; a call in flight finishes
// on the kernels it started with.
#pragma once
#include <cstdint>
#include <string_view>

namespace dspark {

enum class KernelFamily : std::uint8_t { RowFormat = 0, Crc32c = 1 };
inline constexpr int KERNEL_FAMILY_COUNT = 2;

// The variable that forces paths, and its deprecated CRC-32C-only predecessor.
inline constexpr const char* KERNEL_ENV = "DSPARK_SIMD";
inline constexpr const char* KERNEL_ENV_DEPRECATED = "DSPARK_CRC32C";

// "row_format", "crc32c"; nullptr past the last family.
const char* kernel_family_name(KernelFamily f) noexcept;
// Name of path `path` of family f ("scalar", "avx2", ... / "portable",
// "sse4.2", ...), or nullptr past its last path (or for an unknown family).
const char* kernel_path_name(KernelFamily f, int path) noexcept;
int kernel_path_count(KernelFamily f) noexcept;
// The path of f named `name` (case-insensitive, aliases included), or -1.
int kernel_path_from_name(KernelFamily f, std::string_view name) noexcept;

// Whether this build has the path's kernels and this CPU (and OS) can run them.
bool kernel_path_supported(KernelFamily f, int path) noexcept;
int best_kernel_path(KernelFamily f) noexcept;
int active_kernel_path(KernelFamily f) noexcept;
// Process-wide. Throws std::invalid_argument for an unknown family, a path
// out of range or one this CPU / build does not support (nothing changes).
void set_kernel_path(KernelFamily f, int path);

// The kernels of a family's path table, for the dispatch table: kernel `k`'s
// name ("f32->f16", "q8_0 encode", "crc32c", ...; nullptr past the last) and
// the path whose code path `path` runs for it (a path may borrow another's
// kernel: the AVX-512 table decodes with the AVX2 kernels), or nullptr when
// `path` is unsupported.
const char* kernel_name(KernelFamily f, int k) noexcept;
const char* kernel_origin(KernelFamily f, int k, int path) noexcept;

// What DSPARK_SIMD holds, as last read: Unset (absent or empty), Used (every
// name applied), Unknown (a name that is no path), Unsupported (a path this
// CPU / build lacks). Unknown wins over Unsupported.
enum class KernelEnv : std::uint8_t { Unset = 0, Used = 1, Unknown = 2, Unsupported = 3 };
KernelEnv kernel_env_status() noexcept;
// Whether the deprecated DSPARK_CRC32C is set (non-empty).
bool kernel_env_deprecated() noexcept;

// What the one probe found (x86: cpuid + xgetbv, so that the OS has enabled
// the vector state; aarch64: the kernel's hwcaps through getauxval). Only
// features of the architecture this was built for are ever true.
struct CpuFeatures {
    bool sse42 = false, avx2 = false, f16c = false;
    bool avx512 = false;  // F, DQ, BW and VL, with the ZMM state enabled
    bool asimd = false;   // Advanced SIMD (NEON), with its fp16 <-> fp32 conversions
    bool crc32 = false;   // the ARMv8 CRC32 / CRC32C instructions
    bool bf16 = false;    // FEAT_BF16 (BFCVTN)
    // The vendor is AMD (cpuid "AuthenticAMD" / "HygonGenuine"). Never a path's
    // requirement: only a tuning choice that changes no result (crc32c_sse42.cpp).
    bool amd = false;
};
const CpuFeatures& cpu_features() noexcept;

}  // namespace dspark
