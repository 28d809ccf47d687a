// Row formats: the storage encodings of feature rows and the conversions
// between them. Bit-exact with ggml's reference quantizers (quantize_row_*_ref)
// on every SIMD path; see docs/design.md section 3.
//
// All functions take contiguous rows (row i of `dim` elements starts at
// element i * dim) and never allocate. They are thread-safe.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace dspark {

// Elements per quantization block (ggml's QK8_0 == QK4_0 == 32).
inline constexpr std::size_t QK = 32;
// Bytes of one block: fp16 scale + 32 int8 / 16 packed nibbles.
inline constexpr std::size_t Q8_0_BLOCK_BYTES = 2 + QK;
inline constexpr std::size_t Q4_0_BLOCK_BYTES = 2 + QK / 2;

// How rows are kept in the feature buffer.
enum class Storage : std::uint8_t { F32 = 0, F16 = 1, BF16 = 2, Q8_0 = 3, Q4_0 = 4 };
inline constexpr int STORAGE_COUNT = 5;

// Plain float element types rows arrive in and are staged out in.
enum class ElemType : std::uint8_t { F32 = 0, F16 = 1, BF16 = 2 };

// What encoding does with NaN / +-Inf inputs.
//  Error:    convert as-is (NaN kept quiet) and report the first non-finite
//            element; the caller decides (the stager rejects the whole call).
//  Zero:     non-finite -> 0.
//  ClampF16: NaN -> 0, everything clamped to [-65504, 65504] (llama.cpp's
//            DFlash path for fp16 drafter caches).
enum class NonFinite : std::uint8_t { Error = 0, Zero = 1, ClampF16 = 2 };

// SIMD kernel families. Every path produces identical bytes.
enum class SimdPath : std::uint8_t { Scalar = 0, Avx2 = 1, Avx512 = 2 };

// Bytes of one row of `dim` elements in `s`. Throws ConfigError when a q
// format gets dim % 32 != 0 or dim == 0.
std::size_t row_bytes(Storage s, std::size_t dim);
std::size_t elem_bytes(ElemType t) noexcept;

// Names used across the Python API: "f32", "f16", "bf16", "q8_0", "q4_0".
const char* storage_name(Storage s) noexcept;
// Elements per block of a storage: QK for the block-quantised formats, 1 for
// the float ones. A row of `dim` elements (a multiple of it) takes
// dim / storage_block_elems(s) blocks of row_bytes(s, storage_block_elems(s))
// bytes. Throws TypeError for a value that is not a Storage.
std::size_t storage_block_elems(Storage s);
// Name of a non-finite policy ("error", "zero", "clamp_f16"), or nullptr for
// a value past the last policy: the binding enumerates the policies with it,
// so the Python tables follow this enum without a copy.
const char* nonfinite_name(NonFinite p) noexcept;
// Throws ConfigError naming the bad value and the allowed ones.
Storage storage_from_name(std::string_view name);

// Encode n_rows rows from `src` (element type `in`) into `dst` (row_bytes(out,
// dim) bytes per row). Under NonFinite::Error every row is still fully
// converted; the return value is the flat element index (row * dim + col) of
// the first non-finite input element, or -1 when all were finite. Under the
// other policies the return value is always -1.
std::int64_t encode_rows(const void* src, ElemType in, void* dst, Storage out,
                         std::size_t n_rows, std::size_t dim, NonFinite policy);

// Flat index of the first non-finite element of n_elems elements, or -1.
std::int64_t find_nonfinite(const void* src, ElemType in, std::size_t n_elems);

// Decode n_rows rows stored as `in` into `dst` (element type `out`). Exact to
// f32; to f16 / bf16 it is one round-to-nearest-even step of the f32 value.
void decode_rows(const void* src, Storage in, void* dst, ElemType out,
                 std::size_t n_rows, std::size_t dim);

// Runtime dispatch. The active path starts as the best one this CPU supports,
// unless the environment variable DSPARK_SIMD=scalar|avx2|avx512 names
// another (an unsupported or unknown name falls back to the best supported
// path). set_simd_path throws std::invalid_argument for an unsupported path.
bool simd_supported(SimdPath p) noexcept;
SimdPath best_simd_path() noexcept;
SimdPath active_simd_path() noexcept;
void set_simd_path(SimdPath p);
const char* simd_path_name(SimdPath p) noexcept;

}  // namespace dspark
